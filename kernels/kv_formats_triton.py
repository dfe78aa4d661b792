"""The Triton side of packed KV records (kernels/kv_formats.py): the `kv_pack` backend of both Triton sets (the
row quantizer of kernels/quant_triton.py, one launch, the reference's records byte for byte; row-local, so
invariant as it is), and reading records inside the attention and indexer kernels, which decode the rows they
gather in registers, so an FP8 cache is read at its own bytes (no unpacked copy).

`record_args(store)` gives a kernel what it needs of one store part: the records as uint8 (and as bf16, for V4's
bf16 RoPE slice), the row stride in bytes, and the format's constants (kind, quantized channels, scale offset,
channels per scale, scale kind). `load_records` decodes [rows, channels] to fp32, exactly as `KVFormat.unpack`:
e4m3 / e2m1 values times their ue8m0 (2^(b - 127)) or e4m3 scale, the bf16 tail as stored."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kv_formats import KVFormat, PackedStore
from .quant_triton import pack_kernel
from .quant_triton import supported as pack_supported

try:
    import triton
    import triton.language as tl

    from .quant_triton import e2m1_over_2p14
except ImportError:          # CPU-only installs
    triton = None

PLAIN, FP8, FP4 = 0, 1, 2


class RecordArgs(NamedTuple):
    p8: torch.Tensor          # records as uint8 [M, B] (a plain store: the store itself)
    p16: torch.Tensor         # records as bf16 [M, B / 2] (the tail's view; = p8 when the format has none)
    stride: int               # row stride, in p8's elements
    kind: int                 # PLAIN, FP8, FP4
    quantized: int            # channels on the 8/4-bit grid
    scale_offset: int         # byte of the first scale
    block: int                # channels per scale
    e4m3: bool                # scales are e4m3 bytes (else ue8m0)

    @property
    def constexprs(self) -> tuple:
        return self.kind, self.quantized, self.scale_offset, self.block, self.e4m3


def record_args(part) -> RecordArgs:
    """A store part (a tensor [M, d] or a PackedStore [M, d]) as a kernel reads it."""
    if not isinstance(part, PackedStore):
        t = part if part.stride(-1) == 1 else part.contiguous()
        return RecordArgs(t, t, t.stride(0), PLAIN, 0, 0, 1, False)
    data, fmt = part.data, part.fmt
    if data.stride(-1) != 1 or data.stride(0) != fmt.record_bytes:
        data = data.contiguous()
    p16 = data.view(torch.bfloat16) if fmt.tail else data
    return RecordArgs(data, p16, data.stride(0), FP8 if fmt.kind == "fp8" else FP4, fmt.quantized,
                      fmt.scale_offset, fmt.block, fmt.scale == "e4m3" and fmt.kind == "fp4")


def readable(part, width: int) -> bool:
    """Whether the kernels decode this part in place: a PackedStore of `width` values in bf16 or fp32 whose bf16
    tail (if any) lines up for the bf16 view. fp16 stores go through the reference: the decode multiplies in the
    key dtype, and an FP4 scale times the decode's 2^14 can pass fp16's 65504."""
    return isinstance(part, PackedStore) and part.fmt.width == width and part.fmt.record_bytes % 2 == 0 and \
        part.dtype in (torch.bfloat16, torch.float32)


def kv_pack_triton(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if not pack_supported(fmt, flat):
        return fmt.pack(x)
    return pack_kernel(fmt, flat).view(*lead, fmt.record_bytes)


if triton is not None:

    @triton.jit
    def load_records(p8, p16, off, d, ok, D, KIND: tl.constexpr, Q: tl.constexpr, SOFF: tl.constexpr,
                     BLK: tl.constexpr, E4M3: tl.constexpr, OUT: tl.constexpr):
        """Rows at byte offsets off [R] (int64; ok [R] the rows to read), channels d [C] < D -> OUT [R, C]
        (bf16 or fp32: e4m3 or e2m1 values times a power-of-two or e4m3 scale have at most 7 significant bits and
        fp32's exponent range, so the products are exact in either; `readable` keeps fp16 out); unread rows and
        channels are 0."""
        quant = d < Q
        m = ok[:, None] & quant[None, :]
        if KIND == 1:
            b = tl.load(p8 + off[:, None] + d[None, :], mask=m, other=0)
            v = b.to(tl.float8e4nv, bitcast=True).to(OUT)
        else:
            # e2m1 by bit construction (the expert kernel's decode): value * 2^-14, the 2^14 goes into the scale
            b = tl.load(p8 + off[:, None] + (d // 2)[None, :], mask=m, other=0).to(tl.int32)
            v = e2m1_over_2p14((b >> ((d % 2) * 4)[None, :]) & 15).to(OUT)
        sb = tl.load(p8 + off[:, None] + SOFF + (d // BLK)[None, :], mask=m, other=0)
        if E4M3:
            scale = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            scale = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)               # 2^(b - 127)
        if KIND == 2:
            scale = scale * 16384.0                                                    # the decode's 2^14
        v = v * scale.to(OUT)
        if KIND == 1:
            if Q < SOFF:                                                              # a bf16 tail
                v += tl.load(p16 + (off // 2)[:, None] + (d - Q // 2)[None, :],
                             mask=ok[:, None] & (~quant & (d < D))[None, :], other=0.0).to(OUT)   # v is 0 there
        return v
