"""KV compressor (CSA with overlapping windows, HCA without) and the lightning indexer.

Entry w of a compressor with ratio m pools the tokens of window w (positions w*m .. w*m+m-1):
a softmax over the slots, separately per channel, of `gate + ape[slot]`, weights the projected
`kv`; the pooled vector is RMS-normed and roped at position w*m. With overlap (CSA) every token
projects two halves: A (first d channels) feeds the *next* window's entry, B its own, so entry w
pools 2m slots: the A halves of window w-1 and the B halves of window w.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.softmax_pool import softmax_pool
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.rope import apply_rope

from ..common.layers import Linear, RMSNorm, fp32_param
from ..common.rope import RotaryEmbedding


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

    def entries(self, kv: torch.Tensor, gate: torch.Tensor, prev_a: tuple[torch.Tensor, torch.Tensor] | None,
                starts: torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
        """Closed windows kv, gate [n, r, c*d] (>= fp32) starting at positions `starts` [n] (window w: w * r; a
        static step's rows closing none start elsewhere, their entries go to scratch) -> entries [n, d] fp32
        (normed and roped at starts). A slot's score is its gate + ape[slot], slot = position % r: the bias is
        added here, once per window, rather than to every token's gate (a window's slots are its positions in
        order). With overlap, prev_a = (kv, gate) [n, r, d]: the A halves each window pools from its predecessor
        (zero weight for window 0); they come first, then this window's B halves."""
        n, r, d = kv.shape[0], self.ratio, self.head_dim
        if self.overlap:
            kv, gate = torch.cat([prev_a[0], kv[..., d:]], dim=1), torch.cat([prev_a[1], gate[..., d:]], dim=1)
            # [n, 2, r, d] + ape's A and B halves [2, r, d] (a view): slots 0..r-1 the A halves, then the B halves
            score = (gate.view(n, 2, r, d) + self.ape.view(r, 2, d).transpose(0, 1)).view(n, 2 * r, d)
        else:
            score = gate + self.ape                                       # [n, r, d] + [r, d]
        pooled = softmax_pool(kv, score)                                  # [n, d]
        return apply_rope(self.norm(pooled), *rope(starts))


class Indexer(nn.Module):
    """Lightning indexer: scores compressed entries by sum_h w_h * ReLU(q_h . k); the attention keeps the top-k."""

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
