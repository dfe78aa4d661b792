"""Triton helpers for the FP8 / FP4 kernels (kernels/fp8_linear.py, experts_triton.py, kv_formats_triton.py,
quant_triton.py): the activation quantizer per block (quant.fake_quant_fp8's rule, ue8m0 scale), the power-of-two
ceiling it uses, a round-to-nearest-even fp32 -> e4m3 conversion in integer arithmetic for Triton's interpreter,
whose own cast does not round (SOFT_CVT), and the e2m1 decode built as fp16 bits."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:       # no Triton: nothing here is used
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
