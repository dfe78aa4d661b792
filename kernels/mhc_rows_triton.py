"""Triton `hc_collapse` and `hc_post` (issue 15, plan step 5): the mHC's per-row stream sums in one launch each,
where the invariant backend runs the torch reference once per 16-row tile (at batch 256 these row-tiled pieces
are among the step's hundreds of small kernels on the H200: docs/results.md, session 23).

Contracts (kernels/mhc.py), streams h [N, hc, D], math in fp32, outputs in h's dtype:
    hc_collapse(h, pre [N, hc])                 -> [N, D]:      sum_j pre[n, j] * h[n, j, :]
    hc_post(f [N, D], h, post [N, hc], comb [N, hc, hc]) -> [N, hc, D]:
                                                 post[n, k] * f[n, :] + sum_j comb[n, j, k] * h[n, j, :]
Program (n, d-block): row n's hc streams over BLOCK_D columns, the j-sums in order j = 0..hc-1. Row-local with a
fixed order, so a row's bits never depend on its batch: one kernel serves `triton` and `triton_invariant`.

Numerics: the reference sums j with torch's reduction / a batched matmul; the kernel in order: interpreter
(fp32) <= 1e-6 of max (tests/interpreted/test_mhc_rows_triton.py).

GPU status: `pytest -m gpu tests/test_kernels_mhc_rows_triton.py`
passed on an H200 (session 24), so it is in the Triton sets (IN_TRITON_SETS).
"""

from __future__ import annotations

import torch

from .registry import implements, is_interpreted, on_kernel_device

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

IN_TRITON_SETS = True     # passed `pytest -m gpu tests/test_kernels_mhc_rows_triton.py` on an H200 (docs/results.md)
BLOCK_D, WARPS = 1024, 4
MAX_HC = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(h: torch.Tensor, *others: torch.Tensor) -> bool:
    """h [N, hc, D] of a kernel dtype with hc <= MAX_HC, the others on its device."""
    if triton is None or h.dim() != 3 or h.dtype not in DTYPES or h.shape[1] > MAX_HC or h.numel() == 0:
        return False
    return on_kernel_device(INTERPRETED, h, *others)


if triton is not None:

    @triton.jit
    def _collapse_kernel(h_ptr, pre_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = d < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(HC):
            w = tl.load(pre_ptr + n * HC + j).to(tl.float32)
            acc += w * tl.load(h_ptr + (n * HC + j) * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _post_kernel(f_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = d < D
        f = tl.load(f_ptr + n * D + d, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(HC):
            mixed = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for j in tl.static_range(HC):
                c = tl.load(comb_ptr + (n * HC + j) * HC + k).to(tl.float32)
                mixed += c * tl.load(h_ptr + (n * HC + j) * D + d, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(post_ptr + n * HC + k).to(tl.float32)
            tl.store(out_ptr + (n * HC + k) * D + d, (p * f + mixed).to(out_ptr.dtype.element_ty), mask=mask)

    INTERPRETED = is_interpreted(_collapse_kernel)
else:
    INTERPRETED = False


def hc_collapse_kernel(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    n, hc, d = h.shape
    h, pre = h.contiguous(), pre.to(torch.float32).contiguous()
    out = torch.empty((n, d), dtype=h.dtype, device=h.device)
    _collapse_kernel[(n, triton.cdiv(d, BLOCK_D))](h, pre, out, d, HC=hc, BLOCK_D=BLOCK_D, num_warps=WARPS)
    return out


def hc_post_kernel(f: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    n, hc, d = h.shape
    f, h = f.reshape(n, d).contiguous(), h.contiguous()
    post, comb = post.to(torch.float32).contiguous(), comb.to(torch.float32).contiguous()
    out = torch.empty_like(h)
    _post_kernel[(n, triton.cdiv(d, BLOCK_D))](f, h, post, comb, out, d, HC=hc, BLOCK_D=BLOCK_D, num_warps=WARPS)
    return out


def hc_collapse_triton(h, pre):
    from .mhc import _hc_collapse
    return hc_collapse_kernel(h, pre) if supported(h, pre) else _hc_collapse(h, pre)


def hc_post_triton(f, h, post, comb):
    from .mhc import _hc_post
    return hc_post_kernel(f, h, post, comb) if supported(h, f, post, comb) else _hc_post(f, h, post, comb)


def hc_collapse_triton_invariant(h, pre):          # row-local: the same kernel; the fallback on row tiles
    from .mhc import _hc_collapse_tiles
    return hc_collapse_kernel(h, pre) if supported(h, pre) else _hc_collapse_tiles(h, pre)


def hc_post_triton_invariant(f, h, post, comb):
    from .mhc import _hc_post_tiles
    return hc_post_kernel(f, h, post, comb) if supported(h, f, post, comb) else _hc_post_tiles(f, h, post, comb)


if triton is not None and IN_TRITON_SETS:
    implements("hc_collapse", "triton")(hc_collapse_triton)
    implements("hc_post", "triton")(hc_post_triton)
    implements("hc_collapse", "triton_invariant")(hc_collapse_triton_invariant)
    implements("hc_post", "triton_invariant")(hc_post_triton_invariant)
