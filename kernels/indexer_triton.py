"""Triton lightning-indexer scores (issue 15, step 5 of docs/attention-plan.md): `sparse_index_scores` with each
row's candidate keys read by index straight from the key store, no gathered [rows, K, dI] copy and no per-head
[rows, h, K] score tensor.

Contract (kernels/indexer.py): q [N, h, dI], weights [N, h], store [M, dI], index [N, K] rows of the store (-1: no
candidate) -> [N, K] fp32, sum_h w_h * scale * ReLU(q_h . k), -inf where the index is -1.

Program (n, j): row n, candidates [j*BLOCK_K, +BLOCK_K): keys [BLOCK_K, dI] gathered by index, q [h, dI] times
keys^T on tensor cores (fp32 accumulate; fp32 inputs at ieee precision), ReLU, the scale, the head-weighted sum
over h in fp32. A score depends only on its row's q and its key, whatever the tiling or the batch, so the kernel is
batch-invariant as it is and serves both Triton sets. Top-k stays on its torch implementation (a stable sort) in
both sets: the radix select (docs/attention-plan.md step 6) is next.

Numerics: the head sum runs in a different order than the reference's, so scores differ in the last bits; near
ties can then select differently (GPU tests compare scores, not selections). Interpreter, fp32: <= 1e-6 of the
row's max |score| (tests/interpreted/test_indexer_triton.py).

GPU status: interpreter and sm_90 compile only; outside the Triton sets (IN_TRITON_SETS) until `pytest -m gpu
tests/test_kernels_indexer_triton.py` passes.
"""

from __future__ import annotations

import torch

from .registry import implements

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

IN_TRITON_SETS = False
BLOCK_K = 64                 # candidates per program
WARPS = 4


def _pow2(n: int, least: int = 16) -> int:
    p = least
    while p < n:
        p *= 2
    return p


def supported(q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, index: torch.Tensor) -> bool:
    if triton is None or q.dim() != 3 or store.dim() != 2 or q.shape[1] > 128 or q.shape[2] > 256:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or store.dtype != q.dtype:
        return False
    tensors = (q, weights, store, index)
    return all(t.is_cuda for t in tensors) or (INTERPRETED and not any(t.is_cuda for t in tensors))


if triton is not None:

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, s_ptr, i_ptr, o_ptr, H, DI, K, stride_qn, stride_qh, stride_wn,
                             stride_s, stride_in, stride_on, scale,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok, d_ok, j_ok = h < H, d < DI, j < K
        q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)                                                   # [BLOCK_H, BLOCK_D]
        w = tl.load(w_ptr + n * stride_wn + h, mask=h_ok, other=0.0).to(tl.float32)
        idx = tl.load(i_ptr + n * stride_in + j, mask=j_ok, other=-1)
        ok = idx >= 0
        keys = tl.load(s_ptr + idx[:, None] * stride_s + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        if F32:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")               # [BLOCK_H, BLOCK_K] fp32
        else:
            s = tl.dot(q, tl.trans(keys))
        s = tl.maximum(s, 0.0) * scale
        score = tl.sum(s * w[:, None], axis=0)                                   # [BLOCK_K]
        score = tl.where(ok, score, float("-inf"))
        tl.store(o_ptr + n * stride_on + j, score, mask=j_ok)

    INTERPRETED = type(_index_scores_kernel).__name__ == "InterpretedFunction"
else:
    INTERPRETED = False


def index_scores_kernel(q, weights, store, index, scale) -> torch.Tensor:
    """The kernel on `supported` inputs (callers check)."""
    n, h, di = q.shape
    k = index.shape[1]
    out = torch.empty((n, k), dtype=torch.float32, device=q.device)
    if n == 0 or k == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    store = store if store.stride(-1) == 1 else store.contiguous()
    weights = weights.contiguous()
    index = index if index.stride(-1) == 1 else index.contiguous()
    _index_scores_kernel[(n, triton.cdiv(k, BLOCK_K))](
        q, weights, store, index, out, h, di, k, q.stride(0), q.stride(1), weights.stride(0), store.stride(0),
        index.stride(0), out.stride(0), float(scale), BLOCK_H=_pow2(h), BLOCK_D=_pow2(di), BLOCK_K=BLOCK_K,
        F32=q.dtype == torch.float32, num_warps=WARPS)
    return out


def sparse_index_scores_triton(q, weights, store, index, scale):
    if not supported(q, weights, store, index):
        from .indexer import _sparse_index_scores
        return _sparse_index_scores(q, weights, store, index, scale)
    return index_scores_kernel(q, weights, store, index, scale)


def sparse_index_scores_triton_invariant(q, weights, store, index, scale):
    if not supported(q, weights, store, index):
        from .indexer import _sparse_index_scores_tiles
        return _sparse_index_scores_tiles(q, weights, store, index, scale)
    return index_scores_kernel(q, weights, store, index, scale)      # row-independent: invariant as it is


if triton is not None and IN_TRITON_SETS:
    implements("sparse_index_scores", "triton")(sparse_index_scores_triton)
    implements("sparse_index_scores", "triton_invariant")(sparse_index_scores_triton_invariant)
