"""Sink attention over one shared K=V latent (MQA, one KV head): the torch reference."""

import torch
from .matmul import is_batch_invariant, row_tiles
from .precision import upcast


# fp32 scores per row block of the one-sequence reference: queries go through in blocks of about this many
# scores (512 MiB; the softmax temporaries make the peak a few times that), so a 16k-token prefill never
# materializes its whole [S, H, K] score tensor.
SCORE_BLOCK_ELEMENTS = 1 << 27


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One sequence.

    q: [S, H, d]; kv: [K, d] (used as both key and value); bias: [S, K] (0 visible, -inf hidden);
    sink: [H] fp32 logits that join the softmax denominator only. Returns [S, H, d].
    Rows are independent: full blocks hold a row count fixed by H and K (the batch never changes it); S only
    decides where the last block ends.
    """
    kv32 = upcast(kv)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (q.shape[1] * (kv.shape[0] + 1)))
    if q.shape[0] <= rows:
        return _sink_attention(q, kv32, bias, sink, scale)
    return torch.cat([_sink_attention(q[i:i + rows], kv32, bias[i:i + rows], sink, scale)
                      for i in range(0, q.shape[0], rows)])


def _sink_attention(q, kv32, bias, sink, scale, kv_dims: str = "kd"):
    """The math: q [S, H, d]; kv32 [K, d] shared by every row ("kd") or [S, K, d] one per row ("skd")."""
    scores = torch.einsum(f"shd,{kv_dims}->shk", upcast(q), kv32) * scale + upcast(bias).unsqueeze(1)
    logits = torch.cat([scores, upcast(sink).view(1, -1, 1).expand(scores.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum(f"shk,{kv_dims}->shd", probs, kv32).to(q.dtype)


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
    return _sink_attention(q, upcast(kv), bias, sink, scale, kv_dims="skd")
