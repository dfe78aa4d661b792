"""Triton `moe_combine` (the contract: kernels/moe_combine.py) for `triton` and `triton_invariant`: program (r, c)
adds row r's k outputs over BLOCK_D columns in the reference's order, in fp32 registers, the same IEEE additions
(bit for bit: tests/interpreted/test_moe_combine_triton.py), one launch where torch takes about k + 4.
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device
from .moe_combine import _reference
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

BLOCK_D = 1024

if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, inv_ptr, shared_ptr, out_ptr, D, TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
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
                                                      HAS_SHARED=shared is not None, BLOCK_D=BLOCK_D, num_warps=4,
                                                      **pdl(y.device))
    return out.to(out_dtype)
