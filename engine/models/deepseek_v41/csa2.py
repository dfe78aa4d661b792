"""CSA2 of DeepSeek-V4.1: compressed KV produced once per source group, shared by the layers after it.

A KV source's compressor turns its own input into pre-RoPE latents: at ratio 1 one per token,
`norm(wkv x)`; at ratio r > 1 one per r tokens, a per-channel softmax over the r slots of the fp32
gate pooling the fp32 `wkv x`, then `norm`. Group j stands for position j*r and is visible to the
query at p once j < (p+1)//r. From a latent come
  - the cache entry: RoPE at j*r (compress rope), FP4 e2m1 with one e4m3 scale per 16 (QAT);
  - the index key:   k_norm(wk(latent)), RoPE at j*r, FP4 with one ue8m0 scale per 32 (QAT).
An index source scores the group's keys with its own queries, sum_h relu(q_h.k) dI^-1/2 w_h, and
keeps the top-k visible entries; the candidate source also keeps its best blocks of entries, and
every later index source scores only inside them (two-level top-k).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.fake_quant import qat_fp4
from deepinfer.kernels.softmax_pool import softmax_pool
from deepinfer.kernels.kv_formats import KVFormat
from deepinfer.kernels.matmul import linear_f32
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.rope import apply_rope

from ..common.layers import Linear, RMSNorm
from ..common.rope import RotaryEmbedding
from ..common.selection import top_k_mask

ENTRY_FP4_BLOCK = 16    # compressed KV: e2m1, one e4m3 scale per 16 channels
INDEX_FP4_BLOCK = 32    # indexer q and k: e2m1, one ue8m0 scale per 32 channels


def entry_record(head_dim: int) -> KVFormat | None:
    """The release's cache record of a compressed entry: FP4 e2m1 per 16 with e4m3 scales (288 B at 512)."""
    return KVFormat.fitting("fp4", head_dim, ENTRY_FP4_BLOCK, scale="e4m3")


def quantize_entry(x: torch.Tensor) -> torch.Tensor:
    return qat_fp4(x, ENTRY_FP4_BLOCK, scale_fmt="e4m3")


def quantize_index(x: torch.Tensor) -> torch.Tensor:
    return qat_fp4(x, INDEX_FP4_BLOCK, scale_fmt="ue8m0")


class Compressor(nn.Module):
    """`attn.compressor` of a KV source: wkv [d, D], wgate [d, D] (ratio > 1 only), norm [d]."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.wkv = Linear(dim, head_dim, dtype)
        self.wgate = Linear(dim, head_dim, dtype) if ratio > 1 else None
        self.norm = RMSNorm(head_dim, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio > 1: x [T, D] -> (kv, gate) [T, d] each in >= fp32, what the open window buffers."""
        return linear_f32(x, self.wkv.weight), linear_f32(x, self.wgate.weight)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Closed groups kv, gate [n, r, d] (slots in position order) -> latents [n, d] in `dtype`."""
        pooled = softmax_pool(kv, gate)                                      # [n, d]
        return self.norm(pooled.to(dtype))


class Indexer(nn.Module):
    """`attn.indexer` of an index source: wq_b [H_I*dI, q_lora], weights_proj [H_I, D]; a source that
    is also a KV source owns wk [dI, d] + k_norm and publishes the group's keys."""

    def __init__(self, dim: int, q_lora_rank: int, head_dim: int, n_heads: int, index_dim: int, topk: int,
                 owns_keys: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.index_dim, self.topk = n_heads, index_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * index_dim, dtype)
        self.weights_proj = Linear(dim, n_heads, dtype)
        if owns_keys:
            self.wk = Linear(head_dim, index_dim, dtype)
            self.k_norm = RMSNorm(index_dim, eps)

    def keys(self, latents: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
             qat_fake_quant: bool) -> torch.Tensor:
        """Pre-RoPE latents [n, d] at `positions` [n] -> index keys [n, dI]."""
        k = apply_rope(self.k_norm(self.wk(latents)), *rope(positions))
        return quantize_index(k) if qat_fake_quant else k

    def queries(self, qr: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                qat_fake_quant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """qr [N, q_lora] (the attention's q_norm(wq_a x)), x [N, D] -> (q [N, H_I, dI], w [N, H_I] >= fp32)."""
        q = apply_rope(self.wq_b(qr).view(qr.shape[0], self.n_heads, self.index_dim), cos, sin)
        if qat_fake_quant:
            q = quantize_index(q)
        return q, upcast(self.weights_proj(x)) * self.n_heads ** -0.5


def block_entries(keep: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """[T, nb] bool per block of `block` entries -> [T, n] bool per entry."""
    return keep.repeat_interleave(block, dim=1)[:, :n]


def candidate_block_mask(scores: torch.Tensor, positions: torch.Tensor, ratio: int, n_blocks: int,
                         block: int) -> torch.Tensor:
    """Level one of the two-level top-k, per block. scores [T, n] (-inf = not visible) -> [T, ceil(n / block)] bool:
    each query's `n_blocks` best blocks of `block` entries (block score = its max), the block holding the query's
    newest visible entry always kept (`block` times smaller than the entry mask, which is what a long prefill keeps
    between layers)."""
    t, n = scores.shape
    padded = torch.nn.functional.pad(scores, (0, -n % block), value=float("-inf"))
    block_scores = padded.view(t, -1, block).amax(dim=-1)                       # [T, nb]
    newest = (positions + (1 - ratio)) // (ratio * block)       # [T] ((p + 1) // ratio - 1) // block; -1: none visible
    ids = torch.arange(block_scores.shape[1], device=scores.device)
    block_scores = block_scores.masked_fill(ids.unsqueeze(0) == newest.unsqueeze(1), float("inf"))
    return top_k_mask(block_scores, n_blocks)
