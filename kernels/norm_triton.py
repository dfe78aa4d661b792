"""Triton RMSNorm for both Triton sets: one launch for every row, where the invariant backend runs the torch
reference once per 16-row tile (at batch 256 the row-tiled norms were hundreds of the step's kernels on the H200:
docs/results.md).

Contract (kernels/norm.py): x [..., n], weight [n] or None -> x's dtype; math in fp32: x * rsqrt(mean(x^2) + eps)
(* weight). Program r normalises rows [r*BLOCK_R, +BLOCK_R): each row loaded whole (BLOCK_N = n rounded up to a
power of two), its sum of squares reduced in registers with one fixed order for a given n, so a row's bits never
depend on its batch or its position in it: one kernel serves `triton` and `triton_invariant`.

Numerics: the reference's mean is torch's reduction order, the kernel's tl.sum's; interpreter (fp32) <= 1e-6 of
max (tests/interpreted/test_norm_triton.py).
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device, pow2
from .norm import _rms_norm, _rms_norm_tiles
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

MAX_N = 16384             # widest row held in registers (hidden 4096 / 5120, head dim 512 of q-norms)
WARPS = 4


def supported(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    if triton is None or x.dim() < 1 or x.shape[-1] > MAX_N or x.numel() == 0:
        return False
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if weight is not None and (weight.shape != (x.shape[-1],) or weight.device != x.device):
        return False
    return on_kernel_device(INTERPRETED, x, *([] if weight is None else [weight]))


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, rows, n, eps, HAS_W: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)               # [BLOCK_R]
        c = tl.arange(0, BLOCK_N)                                            # [BLOCK_N]
        mask = (r[:, None] < rows) & (c[None, :] < n)
        offs = r[:, None].to(tl.int64) * n + c[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)       # [BLOCK_R, BLOCK_N]
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n + eps)                 # [BLOCK_R]
        y = x * inv[:, None]
        if HAS_W:
            w = tl.load(w_ptr + c, mask=c < n, other=0.0).to(tl.float32)
            y = y * w[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    INTERPRETED = is_interpreted(_rms_norm_kernel)
else:
    INTERPRETED = False


def rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The kernel on `supported` inputs (callers check)."""
    n = x.shape[-1]
    flat = x.reshape(-1, n).contiguous()
    out = torch.empty_like(flat)
    block_n = pow2(n)
    block_r = max(1, min(16, 4096 // block_n))          # about 4k fp32 values a program
    rows = flat.shape[0]
    w = weight.contiguous() if weight is not None else flat
    _rms_norm_kernel[(triton.cdiv(rows, block_r),)](flat, w, out, rows, n, float(eps), HAS_W=weight is not None,
                                                    BLOCK_R=block_r, BLOCK_N=block_n, num_warps=WARPS,
                                                    **pdl(flat.device))
    return out.view(x.shape)


def rms_norm_triton(x, weight, eps):
    if not supported(x, weight):
        return _rms_norm(x, weight, eps)
    return rms_norm_kernel(x, weight, eps)


def rms_norm_triton_invariant(x, weight, eps):
    if not supported(x, weight):
        return _rms_norm_tiles(x, weight, eps)
    return rms_norm_kernel(x, weight, eps)             # row-independent: the same kernel
