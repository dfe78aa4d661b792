"""Triton interleaved partial RoPE for both Triton sets: one launch per call, where the reference is about ten
torch kernels (slice, upcast, strided even / odd views, four products, stack, cast, cat), several calls a layer.

Contract (kernels/rope.py): x [N, ..., d] with the rotary slice last (rd = 2 * half channels), cos / sin [N, half]
fp32; pairs (2i, 2i+1) of the slice rotate as one complex number (conjugate when inverse); the other channels are
copied. Program (n, block of the middle rows): BLOCK_M rows of position n, each whole (d <= MAX_D); a rotary
channel j reads its partner j ^ 1 (the slice starts at an even channel), in fp32, out in x's dtype. Elementwise
per row, so one kernel serves every Triton set.

Numerics: the reference's x_e * cos - x_o * sin against the kernel's (a fused multiply-add may round once less):
interpreter (fp32) <= 1e-6 of max; the copied channels are bitwise (tests/interpreted/test_rope_triton.py).
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device, pow2
from .pdl import pdl
from .rope import _rope, _rope_angles

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

MAX_D, WARPS = 1024, 4


def supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    if triton is None or x.dim() < 2 or x.numel() == 0 or x.dtype not in (torch.float32, torch.bfloat16,
                                                                           torch.float16):
        return False
    d, half = x.shape[-1], cos.shape[-1]
    if d > MAX_D or 2 * half > d or (d - 2 * half) % 2 or cos.shape != (x.shape[0], half) or sin.shape != cos.shape:
        return False
    return on_kernel_device(INTERPRETED, x, cos, sin)


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, M, D, HALF, SIGN, BLOCK_M: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)                # [BLOCK_M] rows of position n
        j = tl.arange(0, BLOCK_D)                                            # [BLOCK_D] channels
        first = D - 2 * HALF                                                 # the rotary slice's first channel
        mask = (m[:, None] < M) & (j[None, :] < D)
        base = (n * M + m[:, None]) * D
        x = tl.load(x_ptr + base + j[None, :], mask=mask, other=0.0)
        rot = (j >= first) & (j < D)
        p = tl.where(rot, (j - first) // 2, 0)                               # the pair's cos / sin column
        c = tl.load(cos_ptr + n * HALF + p, mask=rot, other=1.0)
        s = tl.load(sin_ptr + n * HALF + p, mask=rot, other=0.0) * SIGN
        partner = tl.load(x_ptr + base + (j ^ 1)[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
        s = tl.where(j % 2 == 0, -s, s)                                      # even: x_e c - x_o s; odd: x_o c + x_e s
        y = x.to(tl.float32) * c[None, :] + partner * s[None, :]
        y = tl.where(rot[None, :], y.to(out_ptr.dtype.element_ty), x)
        tl.store(out_ptr + base + j[None, :], y, mask=mask)

    @triton.jit
    def _angles_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, N, H, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                       PDL: tl.constexpr):
        """cos / sin [N, H] of pos[n] (as fp32) * inv[h]: the reference's fp32 product, then cos and sin (on the
        GPU libdevice's cosf / sinf, the functions torch's CUDA cos / sin call)."""
        await_inputs(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        h = tl.arange(0, BLOCK_H)
        ok = (n < N)[:, None] & (h < H)[None, :]
        p = tl.load(pos_ptr + n, mask=n < N, other=0).to(tl.float32)
        angle = p[:, None] * tl.load(inv_ptr + h, mask=h < H, other=0.0)[None, :]
        at = n[:, None].to(tl.int64) * H + h[None, :]
        tl.store(cos_ptr + at, tl.cos(angle), mask=ok)
        tl.store(sin_ptr + at, tl.sin(angle), mask=ok)

    INTERPRETED = is_interpreted(_rope_kernel)
else:
    INTERPRETED = False


def rope_kernel(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The kernel on `supported` inputs (callers check)."""
    n, d = x.shape[0], x.shape[-1]
    flat = x.reshape(n, -1, d).contiguous()
    m = flat.shape[1]
    out = torch.empty_like(flat)
    block_d = pow2(d)
    block_m = max(1, min(16, pow2(m, 1), 4096 // block_d))
    _rope_kernel[(n, triton.cdiv(m, block_m))](flat, cos.to(torch.float32).contiguous(),
                                               sin.to(torch.float32).contiguous(), out, m, d, cos.shape[-1],
                                               -1.0 if inverse else 1.0, BLOCK_M=block_m, BLOCK_D=block_d,
                                               num_warps=WARPS, **pdl(flat.device))
    return out.view(x.shape)


def rope_triton(x, cos, sin, inverse):
    if not supported(x, cos, sin):
        return _rope(x, cos, sin, inverse)
    return rope_kernel(x, cos, sin, inverse)


ANGLES_BLOCK = 4096          # rope_angles: rows x columns per program


def rope_angles_triton(positions, inv_freq):
    if (triton is None or positions.dim() != 1 or inv_freq.dim() != 1 or inv_freq.dtype != torch.float32
            or not on_kernel_device(INTERPRETED, positions, inv_freq)):
        return _rope_angles(positions, inv_freq)
    n, h = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((n, h), dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if n and h:
        block_h = pow2(h, 1)
        block_n = max(1, min(pow2(n, 1), ANGLES_BLOCK // block_h))
        _angles_kernel[(triton.cdiv(n, block_n),)](positions.contiguous(), inv_freq.contiguous(), cos, sin, n, h,
                                                   BLOCK_N=block_n, BLOCK_H=block_h, num_warps=4,
                                                   **pdl(positions.device))
    return cos, sin
