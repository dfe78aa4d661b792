"""KV compressor (CSA with overlapping windows, HCA without) and the lightning indexer.

Entry w of a compressor with ratio m pools the tokens of window w (positions w*m .. w*m+m-1):
a softmax over the slots, separately per channel, of `gate + ape[slot]`, weights the projected
`kv`; the pooled vector is RMS-normed and roped at position w*m. With overlap (CSA) every token
projects two halves: A (first d channels) feeds the *next* window's entry, B its own, so entry w
pools 2m slots: the A halves of window w-1 and the B halves of window w.
"""

from __future__ import annotations

import torch
from deepinfer.kernels.softmax_pool import softmax_pool
from deepinfer.kernels.indexer import index_scores
from deepinfer.kernels.precision import upcast
from torch import nn

from deepinfer.kernels.rope import apply_rope

from ..cache.sequence_state import CompressorState
from .layers import Linear, RMSNorm, fp32_param
from .rope import RotaryEmbedding
from .selection import top_k_mask, visible_entries


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(dim, width, dtype)
        self.wgate = Linear(dim, width, dtype)
        self.ape = fp32_param(ratio, width)
        self.norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (kv, gate), each [N, c*d]. Per token, so it batches across sequences."""
        return self.wkv(x), self.wgate(x)

    def scores(self, gate: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """gate [N, c*d] of tokens at positions [N] -> their pooling scores gate + ape[slot], >= fp32."""
        return upcast(gate) + self.ape[positions % self.ratio]

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, start: int, state: CompressorState,
             rope: RotaryEmbedding) -> torch.Tensor:
        """Feed one sequence's new tokens (absolute positions start..start+T-1); return the entries of
        the windows they close, [n_closed, d] fp32 (normed and roped, before any QAT step)."""
        r, d = self.ratio, self.head_dim
        score = self.scores(gate, torch.arange(start, start + kv.shape[0], device=kv.device))
        kv = upcast(kv)
        if state.pending_kv is not None:
            start -= state.pending_kv.shape[0]
            kv, score = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_score, score])
        n_closed = kv.shape[0] // r
        state.pending_kv, state.pending_score = kv[n_closed * r:], score[n_closed * r:]
        if n_closed == 0:
            return kv.new_zeros(0, d)
        kv = kv[: n_closed * r].view(n_closed, r, -1)
        score = score[: n_closed * r].view(n_closed, r, -1)
        prev_a = self._predecessors(kv, score, state) if self.overlap else None
        return self.entries(kv, score, prev_a, torch.arange(n_closed, device=kv.device) + start // r, rope)

    def entries(self, kv: torch.Tensor, score: torch.Tensor, prev_a: tuple[torch.Tensor, torch.Tensor] | None,
                windows: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """Closed windows kv, score [n, r, c*d] with window indices `windows` [n] -> entries [n, d] fp32 (normed
        and roped at windows * r). With overlap, prev_a = (kv, score) [n, r, d]: the A halves each window pools
        from its predecessor (no_predecessor for window 0); they come first, then this window's B halves."""
        if self.overlap:
            d = self.head_dim
            kv, score = torch.cat([prev_a[0], kv[..., d:]], dim=1), torch.cat([prev_a[1], score[..., d:]], dim=1)
        pooled = softmax_pool(kv, score)                                  # [n, d]
        return apply_rope(self.norm(pooled), *rope(windows * self.ratio))

    def _predecessors(self, kv: torch.Tensor, score: torch.Tensor, state: CompressorState):
        """[n, r, 2d] closed windows -> the A halves [n, r, d] (kv, score) of each one's predecessor; keeps the
        last window's A halves in `state`."""
        d = self.head_dim
        a_kv, a_score = kv[..., :d], score[..., :d]
        if state.prev_a_kv is None:
            prev_kv, prev_score = no_predecessor(a_kv[:1], a_score[:1])
        else:
            prev_kv, prev_score = state.prev_a_kv.unsqueeze(0), state.prev_a_score.unsqueeze(0)
        state.prev_a_kv, state.prev_a_score = a_kv[-1], a_score[-1]
        return torch.cat([prev_kv, a_kv[:-1]]), torch.cat([prev_score, a_score[:-1]])


def no_predecessor(a_kv: torch.Tensor, a_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The A halves window 0 pools from its missing predecessor: zero weight (kv 0, score -inf), shaped like these."""
    return torch.zeros_like(a_kv), torch.full_like(a_score, float("-inf"))


class Indexer(nn.Module):
    """Lightning indexer: scores compressed entries by sum_h w_h * ReLU(q_h . k) and keeps the top-k."""

    def __init__(self, dim: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int, ratio: int,
                 eps: float, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = n_heads, head_dim, topk, ratio
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, dtype)
        self.weights_proj = Linear(dim, n_heads, dtype)
        self.compressor = Compressor(dim, head_dim, ratio, overlap=True, eps=eps, dtype=dtype)

    def queries(self, qr: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Batched over all tokens: q [N, h, dI] roped, head weights [N, h] fp32."""
        q = apply_rope(self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim), cos, sin)
        weights = upcast(self.weights_proj(x)) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)
        return q, weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        """q [T, h, dI], weights [T, h] of queries at positions [T]; keys [n, dI] (one sequence) or [T, n, dI]
        (each query its own) -> [T, n] bool of selected entries: the top-k visible by index_scores."""
        n = keys.shape[-2]
        if n == 0:
            return torch.zeros(q.shape[0], n, dtype=torch.bool, device=q.device)
        visible = visible_entries(positions, n, self.ratio)
        return top_k_mask(index_scores(q, weights, keys).masked_fill(~visible, float("-inf")), self.topk)
