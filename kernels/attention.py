"""Sink attention over one shared K=V latent (MQA, one KV head): the torch reference."""

import torch


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One sequence.

    q: [S, H, d]; kv: [K, d] (used as both key and value); bias: [S, K] (0 visible, -inf hidden);
    sink: [H] fp32 logits that join the softmax denominator only. Returns [S, H, d].
    """
    scores = torch.einsum("shd,kd->shk", q.float(), kv.float()) * scale + bias.float().unsqueeze(1)
    logits = torch.cat([scores, sink.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("shk,kd->shd", probs, kv.float()).to(q.dtype)
