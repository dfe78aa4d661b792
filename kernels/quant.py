"""Torch reference for the DeepSeek-V4 quantization formats (CPU and CUDA, no Triton).

Three groups of functions live here:

* Storage formats of the checkpoint:
  - E8M0 scale bytes (``F8_E8M0`` in safetensors, ``torch.float8_e8m0fnu``).
  - FP8 e4m3 weights with one scale per 128x128 block.
  - FP4 e2m1 expert weights, two values per byte, one E8M0 scale per 32 values along K.
* Activation fake-quantization (quantize then dequantize), the QAT rounding the
  reference inference code applies to the KV latents and the indexer q/k.
* The orthonormal Walsh-Hadamard rotation applied before the indexer's FP4 step.

docs/quantization.md records the reference behaviour each function follows.
All arithmetic is float32; results are cast to the requested dtype at the end.
"""

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0

# Block-amax floors of the reference kernels (see docs/quantization.md).
FP8_AMAX_FLOOR = 1e-4                 # act_quant
FP4_E8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # fp4 quant with a power-of-two scale
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9    # fp4 quant with an e4m3 scale (V4.1 compressed KV)

# Magnitudes of the eight non-negative e2m1 codes 0..7; codes 8..15 are the negatives.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding thresholds between neighbouring grid values. A tie goes to the value with
# an even mantissa bit (0, 1, 2, 4, 6 are even; 0.5, 1.5, 3 are odd), so a tie is
# rounded up where the comparison is ">=" and down where it is ">".
_E2M1_STEPS = (
    (0.25, False),  # 0.25 -> 0
    (0.75, True),   # 0.75 -> 1
    (1.25, False),  # 1.25 -> 1
    (1.75, True),   # 1.75 -> 2
    (2.5, False),   # 2.5  -> 2
    (3.5, True),    # 3.5  -> 4
    (5.0, False),   # 5    -> 4
)


# --------------------------------------------------------------------------- E8M0

def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32. Byte b means 2^(b-127); byte 255 is NaN.

    t: uint8 or torch.float8_e8m0fnu, any shape. Returns float32 of the same shape.
    Byte 0 (2^-127) is a float32 subnormal and is built exactly.
    """
    if t.dtype == torch.float8_e8m0fnu:
        t = t.view(torch.uint8)
    if t.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float expects uint8 or float8_e8m0fnu, got {t.dtype}")
    b = t.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)  # 2^-127 = 0x00400000
    out = bits.view(torch.float32)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def float_to_e8m0(scale_pow2: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Exact powers of two in [2^-127, 2^127] (float32) -> E8M0 bytes (uint8). NaN -> 255.

    With check=True a value that is not an exact power of two in range raises ValueError.
    View the result as torch.float8_e8m0fnu to store it the way safetensors loads F8_E8M0.
    """
    x = scale_pow2.to(torch.float32)
    bits = x.view(torch.int32)
    exp_field = (bits >> 23) & 0xFF                  # biased exponent; 0 for 2^-127
    byte = torch.where(torch.isnan(x), torch.full_like(exp_field, 255), exp_field)
    byte = byte.to(torch.uint8)
    if check:
        ok = (e8m0_to_float(byte) == x) | torch.isnan(x)
        if not bool(ok.all()):
            bad = x[~ok].flatten()[:4].tolist()
            raise ValueError(f"float_to_e8m0 needs exact powers of two in [2^-127, 2^127]; got {bad}")
    return byte


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive float32 x, from the float's bits.

    This is the reference's ``fast_round_scale``: take the exponent field and add one
    when any mantissa bit is set. Exact powers of two map to themselves.
    x: float32, any shape; inputs must be >= 2^-126 (callers floor amax first).
    """
    bits = x.to(torch.float32).view(torch.int32)
    exp_field = (bits >> 23) & 0xFF
    has_mantissa = (bits & 0x7FFFFF) != 0
    k = exp_field - 127 + has_mantissa.to(torch.int32)
    return ((k + 127) << 23).view(torch.float32)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored scale (E8M0 bytes, float8_e8m0fnu, or a float dtype) -> float32."""
    if scale.dtype in (torch.uint8, torch.float8_e8m0fnu):
        return e8m0_to_float(scale)
    return scale.to(torch.float32)


def _mul_f32(x: torch.Tensor, c: float) -> torch.Tensor:
    """x * float32(c), the way a kernel multiplies by a float32 constant."""
    return x * torch.full((), c, dtype=torch.float32, device=x.device)   # a fill, not a host copy (graphs)


def _e8m0_scale(amax: torch.Tensor, qmax: float, floor: float) -> torch.Tensor:
    """Power-of-two scale: 2^ceil(log2(max(amax, floor) * float32(1/qmax)))."""
    return pow2_ceil(_mul_f32(amax.clamp_min(floor), 1.0 / qmax))


# ------------------------------------------------------------------ FP8 e4m3 blocks

def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, saturating at +-448, round to nearest even."""
    return v.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _expand_2d(s: torch.Tensor, rows: int, cols: int, block: Tuple[int, int]) -> torch.Tensor:
    """Block scale [ceil(R/b0), ceil(C/b1)] -> per-element scale [R, C]."""
    s = s.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return s[:rows, :cols]


def quantize_fp8_blocks(
    w: torch.Tensor, block: Tuple[int, int] = (128, 128), scale_fmt: str = "ue8m0"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """w: float [R, C] -> (w_fp8 float8_e4m3fn [R, C], scale [ceil(R/b0), ceil(C/b1)]).

    scale_fmt="ue8m0": the scale is the smallest power of two >= amax/448, stored as
    float8_e8m0fnu. scale_fmt="float32": the scale is amax/448 in float32.
    amax is floored at 1e-4 as in the reference act_quant, so an all-zero block gets
    scale 2^-22 (ue8m0) or 1e-4/448 (float32); its values are zero either way.
    A ragged last block (R or C not a multiple of the block) uses only its real values.
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_blocks expects a 2-D tensor, got {tuple(w.shape)}")
    if scale_fmt not in ("ue8m0", "float32"):
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'float32', got {scale_fmt!r}")
    R, C = w.shape
    b0, b1 = block
    nr, nc = -(-R // b0), -(-C // b1)
    wf = w.to(torch.float32)
    padded = F.pad(wf.abs(), (0, nc * b1 - C, 0, nr * b0 - R))        # [nr*b0, nc*b1]
    amax = padded.view(nr, b0, nc, b1).amax(dim=(1, 3))               # [nr, nc]
    if scale_fmt == "ue8m0":
        scale = _e8m0_scale(amax, FP8_E4M3_MAX, FP8_AMAX_FLOOR)
    else:
        scale = _mul_f32(amax.clamp_min(FP8_AMAX_FLOOR), 1.0 / FP8_E4M3_MAX)
    w_fp8 = _to_e4m3(wf / _expand_2d(scale, R, C, block))              # [R, C]
    if scale_fmt == "ue8m0":
        scale = float_to_e8m0(scale, check=False).view(torch.float8_e8m0fnu)
    return w_fp8, scale


def dequantize_fp8_blocks(
    w_fp8: torch.Tensor, scale: torch.Tensor, block: Tuple[int, int] = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """W[r, c] = fp8[r, c] * scale[r // b0, c // b1], returned as `dtype`.

    w_fp8: float8_e4m3fn [R, C]; scale: float8_e8m0fnu / uint8 / float [ceil(R/b0), ceil(C/b1)].
    """
    R, C = w_fp8.shape
    want = (-(-R // block[0]), -(-C // block[1]))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {want} for {(R, C)}")
    s = _expand_2d(scale_to_float(scale), R, C, block)
    return (w_fp8.to(torch.float32) * s).to(dtype)


# ------------------------------------------------------------------------ FP4 e2m1

def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> e2m1 codes (uint8 in 0..15), round to nearest, ties to even.

    Nibble bits: sign 3, exponent 2..1, mantissa 0. Magnitudes above 6 saturate to 6
    (code 7/15). A negative value that rounds to zero gives -0 (code 8).
    """
    a = x.to(torch.float32).abs()
    mag = torch.zeros_like(a, dtype=torch.uint8)
    for threshold, tie_up in _E2M1_STEPS:
        mag += (a >= threshold if tie_up else a > threshold).to(torch.uint8)
    sign = torch.signbit(x).to(torch.uint8) << 3
    return mag | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (integer tensor, low 4 bits used) -> float32 values (code 8 is -0.0)."""
    c = torch.arange(16, device=codes.device)          # the 16-entry table, computed on the device: no host
    exp, man = (c & 7) >> 1, (c & 1).to(torch.float32)  # constant, so CUDA graphs can capture it
    mag = torch.where(exp == 0, 0.5 * man, torch.exp2((exp - 1).to(torch.float32)) * (1 + 0.5 * man))
    table = torch.where(c >= 8, -mag, mag)
    return table[(codes & 0xF).to(torch.int32)]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., K] -> int8 [..., K//2]; the low nibble holds the even element."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 / uint8 / float4_e2m1fn_x2 [..., K//2] -> codes uint8 [..., K]."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., n] -> float32 [..., n // block, block]; n must be a multiple of block."""
    n = x.shape[-1]
    if block <= 0 or n % block:
        raise ValueError(f"last dim {n} is not a multiple of block {block}")
    return x.to(torch.float32).unflatten(-1, (n // block, block))


def _fp8_scaled(xb: torch.Tensor, round_scale: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blocks [..., nb, b] float32 -> (e4m3 values [..., nb, b], scale [..., nb, 1] fp32): act_quant's rule."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if round_scale:
        scale = _e8m0_scale(amax, FP8_E4M3_MAX, FP8_AMAX_FLOOR)
    else:
        scale = _mul_f32(amax.clamp_min(FP8_AMAX_FLOOR), 1.0 / FP8_E4M3_MAX)
    return _to_e4m3(xb / scale), scale


def _fp4_scaled(xb: torch.Tensor, scale_fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Blocks [..., nb, b] -> (x / scale clamped to +-6 [..., nb, b], scale [..., nb, 1])."""
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if scale_fmt == "ue8m0":
        scale = _e8m0_scale(amax, FP4_E2M1_MAX, FP4_E8M0_AMAX_FLOOR)
    elif scale_fmt == "e4m3":
        scale = _to_e4m3(amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_E2M1_MAX).to(torch.float32)
    else:
        raise ValueError(f"scale_fmt must be 'ue8m0' or 'e4m3', got {scale_fmt!r}")
    return (xb / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX), scale


def quantize_fp4(w: torch.Tensor, block: int = 32) -> Tuple[torch.Tensor, torch.Tensor]:
    """w: float [..., K] -> (packed int8 [..., K//2], scale float8_e8m0fnu [..., K//block]).

    Scale per block: 2^ceil(log2(max(amax, 6*2^-126) * float32(1/6))), the reference
    fp4 quant rule; values are rounded to nearest even on the e2m1 grid after w/scale
    is clamped to +-6. Pass bf16 weights to see exactly what the bf16 kernel sees.
    """
    q, scale = _fp4_scaled(_blocks(w, block), "ue8m0")                # [..., nb, b], [..., nb, 1]
    packed = pack_fp4(e2m1_encode(q).flatten(-2))                     # [..., K//2]
    scale = float_to_e8m0(scale.squeeze(-1), check=False).view(torch.float8_e8m0fnu)
    return packed, scale


def dequantize_fp4(
    packed: torch.Tensor, scale: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """packed [..., K//2] + scale [..., K//block] (E8M0 or float) -> `dtype` [..., K]."""
    vals = e2m1_decode(unpack_fp4(packed))                            # [..., K]
    K = vals.shape[-1]
    if scale.shape[-1] * block != K or scale.shape[:-1] != vals.shape[:-1]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit values {tuple(vals.shape)}")
    s = scale_to_float(scale).repeat_interleave(block, dim=-1)       # [..., K]
    return (vals * s).to(dtype)


# ------------------------------------------------------------- activation fake-quant

def fake_quant_fp8(x: torch.Tensor, block: int, round_scale: bool = True) -> torch.Tensor:
    """FP8 e4m3 quantize-dequantize per `block` channels of the last dim (reference act_quant).

    x: float [..., n] with n % block == 0 -> same shape and dtype.
    scale = 2^ceil(log2(max(amax, 1e-4) * float32(1/448))) (round_scale=True, ue8m0);
    round_scale=False keeps scale = max(amax, 1e-4) * float32(1/448).
    y = e4m3(clamp(x / scale, -448, 448)) * scale, computed in float32.
    """
    q, scale = _fp8_scaled(_blocks(x, block), round_scale)
    y = q.to(torch.float32) * scale
    return y.flatten(-2).to(x.dtype)


def fake_quant_fp4(x: torch.Tensor, block: int, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """FP4 e2m1 quantize-dequantize per `block` channels of the last dim (reference fp4 quant).

    x: float [..., n] with n % block == 0 -> same shape and dtype.
    scale_fmt="ue8m0" (V4 indexer, block 32): scale = 2^ceil(log2(max(amax, 6*2^-126) * float32(1/6))).
    scale_fmt="e4m3" (V4.1 compressed KV, block 16): scale = e4m3(max(amax, 6*2^-9) / 6).
    y = e2m1(clamp(x / scale, -6, 6)) * scale with round-to-nearest-even, in float32.
    """
    q, scale = _fp4_scaled(_blocks(x, block), scale_fmt)
    y = e2m1_decode(e2m1_encode(q)) * scale
    return y.flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------- Hadamard

def hadamard_rotate(x: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Walsh-Hadamard transform along the last dim times n^-0.5 (reference rotate_activation).

    x: float [..., n], n a power of two -> same shape and dtype.
    Uses the Sylvester (natural) ordering H_2n = [[H, H], [H, -H]], which is symmetric,
    so with the default scale n^-0.5 the map is orthonormal and its own inverse.
    Computed with the O(n log n) butterfly in float32.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_rotate needs a power-of-two last dim, got {n}")
    y = x.to(torch.float32).reshape(-1, n)                            # [M, n]
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)                        # [M, groups, 2, h]
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    y = y * (n ** -0.5 if scale is None else scale)
    return y.view(x.shape).to(x.dtype)


def hadamard_matrix(n: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix H/sqrt(n), float32 [n, n] (H symmetric)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix needs a power of two, got {n}")
    return hadamard_rotate(torch.eye(n, device=device))


__all__ = [
    "FP8_E4M3_MAX", "FP4_E2M1_MAX", "E2M1_GRID",
    "e8m0_to_float", "float_to_e8m0", "pow2_ceil",
    "quantize_fp8_blocks", "dequantize_fp8_blocks",
    "e2m1_encode", "e2m1_decode", "pack_fp4", "unpack_fp4", "quantize_fp4", "dequantize_fp4",
    "fake_quant_fp8", "fake_quant_fp4", "hadamard_rotate", "hadamard_matrix",
]
