"""FP8 block-scaled dense GEMM, DeepSeek's W8A8 recipe: `quantize_act_fp8` and `fp8_linear`.

Weights W [N, K] float8_e4m3fn with one scale per 128x128 block, w_scale [ceil(N/128), ceil(K/128)] (e8m0 bytes:
uint8 / float8_e8m0fnu, scale = 2^(b-127); or float32). Activations x [M, K] are quantized on the fly per 1x128
block along K, as quant.fake_quant_fp8(round_scale=True) (DeepSeek's act_quant with ue8m0 scales). The formulas
below are written for V4's block of 128; `block=32` (V4.1's release: 32x32 weight blocks, activations per 1x32)
is the same recipe with 32 for 128 everywhere (the Triton GEMM then steps K by 32 and reads one weight scale per
32 columns):

    scale_x[m, b] = 2^ceil(log2(max(amax_b(x[m]), 1e-4) * float32(1/448)))
    x_fp8[m, k]   = e4m3(clamp(x[m, k] / scale_x[m, k // 128], -448, 448))          (round to nearest even)
    y[m, n]       = sum_b (sum_{k in b} x_fp8[m, k] W_fp8[n, k]) * scale_x[m, b] * scale_w[n // 128, b]

accumulated in fp32, returned as `out_dtype` (default x.dtype). A ragged last K block (K % 128 != 0) takes its
amax over its real values only; a ragged last N block uses its scale row as stored.

Backends (kernels/registry.py):
  reference         torch: quantize x, dequantize x_fp8 * scale_x and W * scale_w to fp32 (exact products of
                    e4m3 values and powers of two) and one fp32 matmul (float64 x: float64 matmul).
  invariant         the reference on fixed row tiles (kernels/tiles.row_tiles): a row's bits do not depend on M.
  triton, triton_invariant   kernels/fp8_linear_triton.py (decode / prefill paths chosen from M; one fixed
                    configuration for the invariant set).

Numerics. The quantization is exact integer/power-of-two arithmetic: every backend's x_fp8 and scale_x equal
quant.fake_quant_fp8's bit for bit (the kernels convert fp32 -> e4m3 with round-to-nearest-even, in integer bits
under the interpreter, whose own fp8 cast does not round to nearest even). The GEMM backends differ only in fp32
rounding: the reference sums all of K in one fp32 matmul, the kernels sum each 128-block in the MMA and add the
scaled partials. Measured against the formula in float64 (tests/test_kernels_fp8_linear.py), as
|y - y64| / (|x_deq| @ |W_deq|^T) elementwise, out_dtype float32, K <= 4096: reference <= 6.6e-8 with e8m0 weight
scales, <= 5.3e-7 with float32 ones (CPU; bound in the tests 1e-6; the a-priori bound is K * 2^-24); interpreter
kernels vs the reference <= 5.5e-7 (bound 1e-6). On Hopper the fp8 MMA accumulates inside a 128-block with fewer
bits than fp32 (the reason for the per-block promotion); the GPU test allows 2e-3 of the same norm, not yet measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import FP8_AMAX_FLOOR, FP8_E4M3_MAX, _e8m0_scale, _to_e4m3, dequantize_fp8_blocks
from .registry import call
from .tiles import row_tiles

BLOCK = 128                 # scale block: 1x128 for activations, 128x128 for weights (V4); V4.1: 32
BLOCKS = (32, 128)          # the scale blocks the op runs
assert FP8_AMAX_FLOOR == 1e-4 and FP8_E4M3_MAX == 448.0


def quantize_act_fp8(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [..., K] -> (x_fp8 float8_e4m3fn [..., K], scale float32 [..., ceil(K/block)]), ue8m0 scales."""
    return call("act_quant_fp8")(x, block)


def fp8_linear(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
               out_dtype: torch.dtype | None = None, block: int = BLOCK) -> torch.Tensor:
    """x [..., K] (activations, quantized per 1 x block inside) @ dequant(w_fp8 [N, K], w_scale [ceil(N/block),
    ceil(K/block)])^T -> [..., N] in out_dtype (default x.dtype). block: 128 (V4's release) or 32 (V4.1's)."""
    return call("fp8_linear")(x, w_fp8, w_scale, out_dtype, block)


def _act_quant_ref(x, block=BLOCK):
    K = x.shape[-1]
    nb = -(-K // block)
    xb = F.pad(x.to(torch.float32), (0, nb * block - K)).unflatten(-1, (nb, block))   # [..., nb, block]
    scale = _e8m0_scale(xb.abs().amax(dim=-1, keepdim=True), FP8_E4M3_MAX, FP8_AMAX_FLOOR)
    q = _to_e4m3(xb / scale).flatten(-2)[..., :K]
    return q, scale.squeeze(-1)


def _check(x, w_fp8, w_scale, block):
    N, K = w_fp8.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} channels, the weight {K}")
    if block not in BLOCKS:
        raise ValueError(f"fp8_linear: block {block} is not one of {BLOCKS}")
    want = (-(-N // block), -(-K // block))
    if tuple(w_scale.shape) != want:
        raise ValueError(f"fp8_linear: weight scale {tuple(w_scale.shape)} does not match {want} for {(N, K)}")


def _fp8_linear_ref(x, w_fp8, w_scale, out_dtype=None, block=BLOCK):
    _check(x, w_fp8, w_scale, block)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    q, s = _act_quant_ref(x, block)
    xd = (q.to(torch.float32) * s.repeat_interleave(block, dim=-1)[..., :x.shape[-1]]).to(work)
    wd = dequantize_fp8_blocks(w_fp8, w_scale, (block, block), torch.float32).to(work)
    return F.linear(xd, wd).to(out_dtype or x.dtype)


def _fp8_linear_tiles(x, w_fp8, w_scale, out_dtype=None, block=BLOCK):
    flat = x.reshape(-1, x.shape[-1])
    y = row_tiles(lambda t: _fp8_linear_ref(t, w_fp8, w_scale, out_dtype, block), flat)
    return y.view(*x.shape[:-1], w_fp8.shape[0])
