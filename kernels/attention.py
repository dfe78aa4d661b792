"""Sink attention over one shared K=V latent (MQA, one KV head): the torch reference."""

import torch
from .matmul import is_batch_invariant, row_tiles
from .precision import upcast


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One sequence.

    q: [S, H, d]; kv: [K, d] (used as both key and value); bias: [S, K] (0 visible, -inf hidden);
    sink: [H] fp32 logits that join the softmax denominator only. Returns [S, H, d].
    """
    scores = torch.einsum("shd,kd->shk", upcast(q), upcast(kv)) * scale + upcast(bias).unsqueeze(1)
    logits = torch.cat([scores, upcast(sink).view(1, -1, 1).expand(scores.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("shk,kd->shd", probs, upcast(kv)).to(q.dtype)


def sink_attention_rows(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """A batch of single queries, each with its own keys (decode over the state pools).

    q: [B, H, d]; kv: [B, K, d]; bias: [B, K] (0 visible, -inf hidden; a row may hide every key,
    then only the sink remains and the output is 0). Returns [B, H, d].
    Batch-invariant mode: fixed tiles of rows, so B cannot change a row's batched-GEMM blocking.
    """
    if is_batch_invariant():
        return row_tiles(lambda q, kv, bias: _sink_attention_rows(q, kv, bias, sink, scale), q, kv, bias)
    return _sink_attention_rows(q, kv, bias, sink, scale)


def _sink_attention_rows(q, kv, bias, sink, scale):
    scores = torch.einsum("bhd,bkd->bhk", upcast(q), upcast(kv)) * scale + upcast(bias).unsqueeze(1)
    logits = torch.cat([scores, upcast(sink).view(1, -1, 1).expand(scores.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("bhk,bkd->bhd", probs, upcast(kv)).to(q.dtype)
