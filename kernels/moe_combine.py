"""`moe_combine`: the MoE layer's last step, one launch where torch takes about k + 4 (a gather, a clone, k - 1
adds, the shared expert's add, the cast; 9 a layer at k = 6, 36 of a 4-layer decode step's launches).

moe_combine(y [M, D] fp32, inverse [M] int64, top_k, shared [N, D] | None, out_dtype) -> [N, D] out_dtype:
    per_row = y[inverse].view(N, k, D)                      (M = N * k; inverse: the dispatch's sorted position of
                                                             each flat (row, slot), slots in ascending expert id)
    out     = ((per_row[:, 0] + per_row[:, 1]) + ...) + per_row[:, k-1]      fp32 (>= y's dtype), this order
    out     = (out + shared).to(out_dtype)                  (shared upcast to the sum's >= fp32 first)
A row's sum has one fixed order whatever the batch, so the reference is batch-invariant and one Triton kernel
serves `triton` and `triton_invariant`: program (r, c) adds row r's k outputs over BLOCK_D columns in that
order, in fp32 registers, the same IEEE additions as the reference (bit for bit: tests/interpreted/
test_moe_combine_triton.py).

GPU status: `pytest -m gpu tests/test_kernels_moe_combine.py` passed on an H200 (12 tests, bit for bit, session 25),
so it is in the Triton sets (IN_TRITON_SETS).
"""

from __future__ import annotations

import torch

from .precision import upcast
from .registry import call, implements, is_interpreted, on_kernel_device

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

__all__ = ["moe_combine"]

IN_TRITON_SETS = True     # passed `pytest -m gpu` on an H200 (docs/results.md)
BLOCK_D = 1024


def moe_combine(y: torch.Tensor, inverse: torch.Tensor, top_k: int, shared: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, D] expert outputs in sorted order, inverse [M] -> [M / top_k, D] out_dtype (module docstring)."""
    return call("moe_combine")(y, inverse, top_k, shared, out_dtype)


@implements("moe_combine", "reference")
def _reference(y, inverse, top_k, shared, out_dtype):
    per_row = upcast(y).index_select(0, inverse).view(-1, top_k, y.shape[-1])
    out = per_row[:, 0].clone()
    for j in range(1, top_k):
        out += per_row[:, j]
    if shared is not None:
        out = out + upcast(shared)
    return out.to(out_dtype)


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, inv_ptr, shared_ptr, out_ptr, D, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = c < D
        src = tl.load(inv_ptr + r * TOP_K)
        acc = tl.load(y_ptr + src * D + c, mask=ok, other=0.0).to(tl.float32)
        for j in tl.static_range(1, TOP_K):
            src = tl.load(inv_ptr + r * TOP_K + j)
            acc += tl.load(y_ptr + src * D + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(shared_ptr + r * D + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + r * D + c, acc.to(out_ptr.dtype.element_ty), mask=ok)

    INTERPRETED = is_interpreted(_combine_kernel)
else:
    INTERPRETED = False


def supported(y, inverse, shared, top_k: int = 1) -> bool:
    """fp32 expert outputs (the grouped kernels' output), 2-D, and the kernels' device."""
    if triton is None or y.dim() != 2 or y.dtype != torch.float32:
        return False
    if shared is not None and (shared.shape[-1] != y.shape[-1] or shared.dtype == torch.float64
                               or shared.numel() * top_k != inverse.numel() * y.shape[-1]):   # [N, D], N = M / k
        return False
    return on_kernel_device(INTERPRETED, y, inverse, *(() if shared is None else (shared,)))


def _triton(y, inverse, top_k, shared, out_dtype):
    if not supported(y, inverse, shared, top_k) or out_dtype == torch.float64:
        return _reference(y, inverse, top_k, shared, out_dtype)
    d = y.shape[-1]
    n = inverse.shape[0] // top_k
    # the interpreter's fp32 -> 16-bit casts truncate; the GPU's round to nearest even, as torch: there the kernel
    # stores out_dtype, under the interpreter fp32 that torch then rounds
    store = torch.float32 if INTERPRETED else out_dtype
    out = torch.empty((n, d), dtype=store, device=y.device)
    if n:
        y, inverse = y.contiguous(), inverse.contiguous()
        sh = shared.reshape(n, d).contiguous() if shared is not None else y
        _combine_kernel[(n, triton.cdiv(d, BLOCK_D))](y, inverse, sh, out, d, TOP_K=top_k,
                                                      HAS_SHARED=shared is not None, BLOCK_D=BLOCK_D, num_warps=4)
    return out.to(out_dtype)


if triton is not None and IN_TRITON_SETS:
    implements("moe_combine", "triton")(_triton)
    implements("moe_combine", "triton_invariant")(_triton)
