"""Triton quantization numerics, the kernels' side of kernels/quant.py: the helpers the FP8 / FP4 kernels share
(kernels/fp8_linear_triton.py, experts_triton.py, kv_formats_triton.py) and the row quantizer behind the
`kv_pack` (kernels/kv_formats_triton.py) and QAT fake-quant (kernels/fake_quant_triton.py) backends.

Helpers: the activation quantizer per block (quant.fake_quant_fp8's rule, ue8m0 scale), the power-of-two ceiling it
uses, a round-to-nearest-even fp32 -> e4m3 conversion in integer arithmetic for Triton's interpreter, whose own cast
does not round (SOFT_CVT), and the e2m1 decode built as fp16 bits.

The row quantizer: program m quantizes row m, its quantized channels as a [blocks, block] tile: amax per block, the
scale by kernels/quant.py's rule (fp8: pow2_ceil(max(amax, 1e-4) * f32(1/448)), ue8m0; fp4 ue8m0: pow2_ceil(max(amax,
6 * 2^-126) * f32(1/6)); fp4 e4m3: e4m3(max(amax, 6 * 2^-9) / 6), correctly rounded division; packing also runs
the reference's search of the next four e4m3 values for one that reproduces the block), the values rounded to
nearest even (e4m3 by the GPU's cvt or e4m3_soft under the interpreter; e2m1 by the reference's thresholds). Then
either the record (two nibbles a byte, low = even channel; V4's tail rounded to bf16 from the float's bits; pad
bytes zero) or the dequantized values in the input's dtype (VALUES). Both equal the reference byte for byte /
bit for bit (tests/interpreted/test_quant_triton.py). One launch per call, where the reference takes about 20 torch
ops per KV write and 20-40 per fake-quant.
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device, pow2
from .kv_formats import KVFormat
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

if triton is not None:

    FLOOR_BITS = tl.constexpr(0x38D1B717)     # float32(1e-4) == FP8_AMAX_FLOOR
    INV448_BITS = tl.constexpr(0x3B124925)    # float32(1/448)

    @triton.jit
    def e4m3_soft(v):
        """fp32 in [-448, 448] -> e4m3fn bytes (int32 0..255), round to nearest even (the interpreter's cast
        is not): |v| >= 2^-6 drops 20 mantissa bits of the float with the carry into the exponent; below, the
        subnormal m * 2^-9 with m = rne(|v| * 2^9) from fp32's own rounding at 2^23."""
        bits = v.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - 960
        sub = ((tl.abs(v) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
        return ((bits >> 24) & 0x80) | tl.where(a >= 0x3C800000, normal, sub)

    @triton.jit
    def pow2_ceil_exponent(v):
        """Positive fp32 (>= 2^-126) -> the biased exponent of 2^ceil(log2 v) (quant.pow2_ceil's bits)."""
        bits = v.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def e2m1_over_2p14(codes):
        """e2m1 codes (int32, 0..15) -> fp32 value * 2^-14, exactly (built as fp16 bits: the sign to bit 15, the
        exponent and mantissa to bits 11..9; 0.5 is an fp16 subnormal)."""
        bits = ((codes & 8) << 12) | ((codes & 7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def quant_tile(xf, SOFT_CVT: tl.constexpr):
        """fp32 tile [R, B] (one scale block per row) -> (fp8e4nv [R, B], scale fp32 [R]): act_quant, ue8m0."""
        amax = tl.max(tl.abs(xf), axis=1)
        floor = tl.full(amax.shape, FLOOR_BITS, tl.int32).to(tl.float32, bitcast=True)
        inv448 = tl.full(amax.shape, INV448_BITS, tl.int32).to(tl.float32, bitcast=True)
        k = pow2_ceil_exponent(tl.maximum(amax, floor) * inv448)             # biased exponent of the scale
        scale = (k << 23).to(tl.float32, bitcast=True)
        inv = ((254 - k) << 23).to(tl.float32, bitcast=True)                 # 1/scale, exact
        v = tl.minimum(tl.maximum(xf * inv[:, None], -448.0), 448.0)
        return to_e4m3(v, SOFT_CVT), scale

    @triton.jit
    def to_e4m3(v, SOFT_CVT: tl.constexpr):
        """fp32 in [-448, 448] -> fp8e4nv, round to nearest even: the GPU's cvt, or e4m3_soft (SOFT_CVT)."""
        if SOFT_CVT:
            return e4m3_soft(v).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        return v.to(tl.float8e4nv)                                           # cvt.rn.satfinite

    @triton.jit
    def _e2m1_code(q):
        """fp32 in [-6, 6] -> e2m1 codes (int32 0..15), nearest with the reference's tie rule, -0 for negative
        values that round to zero."""
        a = tl.abs(q)
        mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + \
            (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
        sign = (q.to(tl.int32, bitcast=True) >> 31) & 1
        return mag | (sign << 3)

    @triton.jit
    def _e2m1_value(code):
        return e2m1_over_2p14(code) * 16384.0                                    # exact: the decode's 2^-14 back

    @triton.jit
    def _e4m3_scale_value(s, SOFT: tl.constexpr):
        """A positive fp32 -> (its e4m3 byte, the byte's value in fp32)."""
        byte = to_e4m3(s, SOFT).to(tl.uint8, bitcast=True).to(tl.int32)
        return byte, byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _quant_kernel(x_ptr, o_ptr, o16_ptr, y_ptr, stride_x, stride_o, stride_y, KIND: tl.constexpr,
                      Q: tl.constexpr, W: tl.constexpr, SOFF: tl.constexpr, B: tl.constexpr, BLK: tl.constexpr,
                      NB: tl.constexpr, NB_PAD: tl.constexpr, E4M3: tl.constexpr, TAIL_PAD: tl.constexpr,
                      PAD_PAD: tl.constexpr, VALUES: tl.constexpr, SOFT: tl.constexpr,
                      HADAMARD: tl.constexpr = 0, HSCALE: tl.constexpr = 1.0, PDL: tl.constexpr = False):
        """Row m: VALUES -> y[m] the fake-quantized values (x's first Q channels); else o[m] the record.
        HADAMARD = log2(Q) > 0: the row is first rotated as quant.hadamard_rotate does it (the same butterfly
        pairs a + b, a - b in fp32, times HSCALE = Q^-0.5, rounded to x's dtype)."""
        await_inputs(PDL)
        m = tl.program_id(0).to(tl.int64)
        blk = tl.arange(0, NB_PAD)
        ch = blk[:, None] * BLK + tl.arange(0, BLK)[None, :]                    # [NB_PAD, BLK] channels
        ok = ch < Q
        x = tl.load(x_ptr + m * stride_x + ch, mask=ok, other=0.0).to(tl.float32)
        if HADAMARD > 0:                                                         # Q == NB_PAD * BLK here
            v = tl.reshape(x, (Q,))
            for i in tl.static_range(HADAMARD):
                p = tl.permute(tl.reshape(v, (Q // (2 << i), 2, 1 << i)), (0, 2, 1))   # [Q / 2h, h, 2]
                a, b = tl.split(p)
                v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (Q,))
            v = (v * HSCALE).to(x_ptr.dtype.element_ty).to(tl.float32)
            x = tl.reshape(v, (NB_PAD, BLK))
        row = o_ptr + m * stride_o
        if KIND == 1:
            e, s = quant_tile(x, SOFT)                                           # fake_quant_fp8's rule per block
            if VALUES:
                tl.store(y_ptr + m * stride_y + ch, (e.to(tl.float32) * s[:, None]).to(y_ptr.dtype.element_ty),
                         mask=ok)
            else:
                tl.store(row + ch, e.to(tl.uint8, bitcast=True), mask=ok)
            sbyte = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
        else:
            amax = tl.max(tl.abs(x), axis=1)                                     # [NB_PAD]
            if E4M3:
                sbyte, s = _e4m3_scale_value(tl.minimum(tl.math.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0),
                                              SOFT)                                  # floor 6 * 2^-9, saturate
                q = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -6.0), 6.0)
                code = _e2m1_code(q)
                if not VALUES:              # packing: the reference's search, the next e4m3 values up
                    found = tl.min((_e2m1_value(code) * s[:, None] == x).to(tl.int32), axis=1) > 0
                    tb = sbyte
                    for _ in range(4):
                        tb = tl.minimum(tb + 1, 0x7E)
                        ts = tb.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
                        tq = tl.minimum(tl.maximum(tl.math.div_rn(x, ts[:, None]), -6.0), 6.0)
                        tcode = _e2m1_code(tq)
                        exact = (tl.min((_e2m1_value(tcode) * ts[:, None] == x).to(tl.int32), axis=1) > 0) & ~found
                        code = tl.where(exact[:, None], tcode, code)
                        sbyte = tl.where(exact, tb, sbyte)
                        found = found | exact
            else:
                sbyte = pow2_ceil_exponent(tl.maximum(amax, 1.1754943508222875e-38 * 6.0) * 0.16666667163372040)
                s = (sbyte << 23).to(tl.float32, bitcast=True)                   # ue8m0: f32(1/6) above
                q = tl.minimum(tl.maximum(x / s[:, None], -6.0), 6.0)            # / a power of two: exact
                code = _e2m1_code(q)
            if VALUES:
                tl.store(y_ptr + m * stride_y + ch, (_e2m1_value(code) * s[:, None]).to(y_ptr.dtype.element_ty),
                         mask=ok)
            else:
                pairs = tl.reshape(code, (NB_PAD * BLK // 2, 2))
                lo, hi = tl.split(pairs)
                j = tl.arange(0, NB_PAD * BLK // 2)
                tl.store(row + j, (lo | (hi << 4)).to(tl.uint8), mask=j < Q // 2)
        if not VALUES:
            tl.store(row + SOFF + blk, sbyte.to(tl.uint8), mask=blk < NB)
            if TAIL_PAD > 0:                                                     # V4: the bf16 RoPE slice
                t = tl.arange(0, TAIL_PAD)
                tv = tl.load(x_ptr + m * stride_x + Q + t, mask=Q + t < W, other=0.0).to(tl.float32)
                bits = tv.to(tl.int32, bitcast=True)
                bf = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16                  # round to nearest even
                tl.store(o16_ptr + m * (stride_o // 2) + Q // 2 + t, bf.to(tl.int16), mask=Q + t < W)
            if PAD_PAD > 0:
                p = SOFF + NB + tl.arange(0, PAD_PAD)
                tl.store(row + p, tl.zeros((PAD_PAD,), tl.uint8), mask=p < B)

    INTERPRETED = is_interpreted(_quant_kernel)
else:
    INTERPRETED = False


def supported(fmt: KVFormat, x: torch.Tensor) -> bool:
    if triton is None or x.dim() != 2 or x.shape[-1] != fmt.width or x.dtype == torch.float64:
        return False
    if fmt.block & (fmt.block - 1) or fmt.record_bytes % 2:
        return False
    return on_kernel_device(INTERPRETED, x)


def _launch(fmt: KVFormat, x: torch.Tensor, values: bool, hadamard: bool = False) -> torch.Tensor:
    x = x if x.stride(-1) == 1 else x.contiguous()
    if values:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((x.shape[0], fmt.record_bytes), dtype=torch.uint8, device=x.device)
    if x.shape[0] == 0:
        return out
    nb = fmt.quantized // fmt.block
    pad = fmt.record_bytes - fmt.scale_offset - nb
    rec = x if values else out                                   # (unused pointers in the other mode)
    _quant_kernel[(x.shape[0],)](
        x, rec, rec if values else out.view(torch.int16), out if values else x, x.stride(0), rec.stride(0),
        out.stride(0) if values else x.stride(0), KIND=1 if fmt.kind == "fp8" else 2, Q=fmt.quantized, W=fmt.width,
        SOFF=fmt.scale_offset, B=fmt.record_bytes, BLK=fmt.block, NB=nb, NB_PAD=pow2(nb, 1),
        E4M3=fmt.kind == "fp4" and fmt.scale == "e4m3", TAIL_PAD=pow2(fmt.tail, 1) if fmt.tail and not values else 0,
        PAD_PAD=pow2(pad, 1) if pad and not values else 0, VALUES=values, SOFT=INTERPRETED,
        HADAMARD=fmt.width.bit_length() - 1 if hadamard else 0, HSCALE=fmt.width ** -0.5, num_warps=4, **pdl(x.device))
    return out


def pack_kernel(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """The packer on `supported` inputs: x [M, width] -> records uint8 [M, record_bytes]."""
    return _launch(fmt, x, values=False)


def fake_quant_kernel(x: torch.Tensor, kind: str, block: int, scale_fmt: str = "ue8m0",
                      hadamard: bool = False) -> torch.Tensor:
    """quant.fake_quant_fp8 (round_scale) / fake_quant_fp4 of x [M, n] (hadamard: of hadamard_rotate(x), n a
    power of two) on `fake_quant_supported` inputs."""
    return _launch(KVFormat(kind, x.shape[-1], block, scale=scale_fmt), x, values=True, hadamard=hadamard)


def fake_quant_supported(x: torch.Tensor, block: int) -> bool:
    if triton is None or x.dim() != 2 or x.dtype == torch.float64 or block & (block - 1) or x.shape[-1] % block:
        return False
    return on_kernel_device(INTERPRETED, x)
