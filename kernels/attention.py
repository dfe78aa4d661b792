"""Sink attention over one shared K=V latent (MQA, one KV head).

Two entry points:
  sink_attention         one sequence, its queries sharing one key list with a visibility bias (the reference
                         SequenceState forward and the DSpark draft block)
  sparse_sink_attention  every query row with its own key list, given as index lists into key stores (the
                         forward over the state pools: window rings, this step's new latents, pooled entries)
The sink is a per-head logit that joins the softmax denominator only."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .precision import upcast
from .registry import call
from .tiles import row_tiles

# fp32 scores per row block: queries go through in blocks of about this many scores (512 MiB; the softmax
# temporaries make the peak a few times that), so a 16k-token prefill never materializes all its scores.
SCORE_BLOCK_ELEMENTS = 1 << 27


class SplitStore(NamedTuple):
    """A key store read in place in two parts: row i < R = ring.shape[0] is ring[i], row R + j is new[j] (a window
    ring pool flattened [slots * span, d], and this step's latents [N, d]: no copy of the ring per step)."""
    ring: torch.Tensor
    new: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.ring.dtype

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """store[index] for index >= 0 (callers mask the rest): [..., d]."""
        r = self.ring.shape[0]
        in_ring = (index < r).unsqueeze(-1)
        return torch.where(in_ring, self.ring[index.clamp(max=r - 1)],
                           self.new[(index - r).clamp(0, max(self.new.shape[0] - 1, 0))])


def store_rows(store, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (>= 0) of a key store: a tensor [M, d] or a SplitStore."""
    return store.rows(index) if isinstance(store, SplitStore) else store[index]


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """One sequence. q [S, H, d]; kv [K, d] (key and value); bias [S, K] (0 visible, -inf hidden);
    sink [H] fp32. Returns [S, H, d]."""
    return call("sink_attention")(q, kv, bias, sink, scale)


def sparse_sink_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Each query row attends to its own keys. q [N, H, d]; sources: (store [M_i, d] or a SplitStore, index
    [N, K_i] int64 rows of the store, -1 = no key); row n's keys are the stores' rows its indices name, in source
    order. A row with no key at all keeps only the sink (output 0). Returns [N, H, d]."""
    return call("sparse_sink_attention")(q, sources, sink, scale)


def _sink_math(q, kv32, bias, sink, scale, kv_dims: str = "kd"):
    """q [S, H, d]; kv32 [K, d] shared by every row ("kd") or [S, K, d] one per row ("skd")."""
    scores = torch.einsum(f"shd,{kv_dims}->shk", upcast(q), kv32) * scale + upcast(bias).unsqueeze(1)
    logits = torch.cat([scores, upcast(sink).view(1, -1, 1).expand(scores.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum(f"shk,{kv_dims}->shd", probs, kv32).to(q.dtype)


def _sink_attention(q, kv, bias, sink, scale):
    """Rows are independent: blocks hold a row count fixed by H and K (the batch never changes it)."""
    kv32 = upcast(kv)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (q.shape[1] * (kv.shape[0] + 1)))
    if q.shape[0] <= rows:
        return _sink_math(q, kv32, bias, sink, scale)
    return torch.cat([_sink_math(q[i:i + rows], kv32, bias[i:i + rows], sink, scale)
                      for i in range(0, q.shape[0], rows)])


def gather_keys(sources: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Index lists -> (keys [n, K, d] >= fp32, zero where there is no key, bias [n, K] fp32: 0 / -inf)."""
    keys, present = [], []
    for store, index in sources:
        keys.append(upcast(store_rows(store, index.clamp(min=0))))
        present.append(index >= 0)
    keys, present = torch.cat(keys, dim=1), torch.cat(present, dim=1)
    keys = torch.where(present.unsqueeze(-1), keys, 0)     # store rows nobody named may hold anything
    bias = torch.zeros(present.shape, dtype=keys.dtype, device=keys.device).masked_fill(~present, float("-inf"))
    return keys, bias


def _sparse_rows(q, sources, sink, scale):
    keys, bias = gather_keys(sources)
    return _sink_math(q, keys, bias, sink, scale, kv_dims="skd")


def _sparse_sink_attention(q, sources, sink, scale):
    n, h, d = q.shape
    k = sum(index.shape[1] for _, index in sources)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (max(h, d) * (k + 1)))
    if n <= rows:
        return _sparse_rows(q, sources, sink, scale)
    return torch.cat([_sparse_rows(q[a:a + rows], [(s, i[a:a + rows]) for s, i in sources], sink, scale)
                      for a in range(0, n, rows)])


def _sparse_sink_attention_tiles(q, sources, sink, scale):
    stores = [s for s, _ in sources]
    return row_tiles(lambda q, *idx: _sparse_rows(q, list(zip(stores, idx)), sink, scale), q,
                     *(i for _, i in sources))
