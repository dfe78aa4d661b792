"""Triton `gather_rows` (the contract: kernels/gather.py) for both Triton sets: program (b, c) copies BLOCK_R
index entries' rows over BLOCK_W columns, each from the ring or the step's rows by its index, the fill where it is
-1. Loads and stores only, so the reference's bits (tests/interpreted/test_gather_triton.py).
"""

from __future__ import annotations

import torch

from .attention import SplitStore
from .gather import _gather_rows
from .gpu import is_interpreted, on_kernel_device, pow2
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

BLOCK_ELEMENTS = 4096        # index entries x columns a program copies

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(ring_ptr, new_ptr, index_ptr, out_ptr, L, W, R, stride_r, stride_n, fill,
                            BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr):
        """out [L, W] row l = ring[i] (i < R) or new[i - R] (i >= R), fill (i < 0), i = index[l]."""
        await_inputs(PDL)
        lr = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cw = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        ok = (lr < L)[:, None] & (cw < W)[None, :]
        i = tl.load(index_ptr + lr, mask=lr < L, other=-1)[:, None]                    # [BLOCK_R, 1] int64
        in_ring = ok & (i >= 0) & (i < R)
        in_new = ok & (i >= R)
        a = tl.load(ring_ptr + tl.where(in_ring, i, 0) * stride_r + cw[None, :], mask=in_ring, other=0)
        b = tl.load(new_ptr + tl.where(in_new, i - R, 0) * stride_n + cw[None, :], mask=in_new, other=0)
        row = tl.where(in_ring, a, b)
        tl.store(out_ptr + lr[:, None].to(tl.int64) * W + cw[None, :], tl.where(i >= 0, row, fill), mask=ok)

    INTERPRETED = is_interpreted(_gather_rows_kernel)
else:
    INTERPRETED = False


def gather_rows_triton(store, index, fill):
    ring, new = (store.ring, store.new) if isinstance(store, SplitStore) else (store, store[:0])
    if triton is None or not on_kernel_device(INTERPRETED, ring, new, index) or index.dtype != torch.long \
            or ring.dim() != 2 or new.dim() != 2 or ring.stride(1) != 1 or new.stride(1) != 1 \
            or ring.dtype == torch.float64:
        return _gather_rows(store, index, fill)
    new = new.to(ring.dtype)                  # as the reference's store (no op when the dtypes agree)
    c, k = index.shape
    w = ring.shape[1]
    out = torch.empty((c, k, w), dtype=ring.dtype, device=ring.device)
    rows = c * k
    if rows and w:
        block_w = min(pow2(w, 1), BLOCK_ELEMENTS)
        block_r = max(1, min(pow2(rows, 1), BLOCK_ELEMENTS // block_w))
        grid = (triton.cdiv(rows, block_r), triton.cdiv(w, block_w))
        fill = float(fill) if ring.dtype.is_floating_point else int(fill)     # an int64 store keeps its fill exact
        _gather_rows_kernel[grid](ring, new if new.numel() else ring, index.contiguous(), out, rows, w,
                                  ring.shape[0], ring.stride(0), new.stride(0) if new.numel() else ring.stride(0),
                                  fill, BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4, **pdl(ring.device))
    return out
