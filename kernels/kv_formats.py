"""Packed KV-cache records: the release's FP8 / FP4 cache layouts (the FP8 KV option).

One record of `record_bytes` per stored row (a window latent, a compressed entry, an indexer key):

  fp8   [ e4m3 x (width - tail) | bf16 x tail | ue8m0 x (width - tail) / block | pad ]
  fp4   [ e2m1 x width, two a byte, low nibble = even channel | scale x width / block (ue8m0 or e4m3) | pad ]

padded to a multiple of 4 bytes (a bf16 view of the records then lines up). The layouts the models declare:

  V4 latent (window and compressed entries)  fp8, 448 e4m3 + 64 bf16 RoPE + 7 ue8m0 per 64   584 B (FlashMLA's)
  V4.1 window                                 fp8, 512 e4m3 + 16 ue8m0 per 32                 528 B
  V4.1 compressed entry                       fp4, 512 e2m1 + 32 e4m3 per 16                  288 B
  V4 / V4.1 indexer key                       fp4, 128 e2m1 + 4 ue8m0 per 32                  68 B

Scales follow kernels/quant.py's fake-quant rules exactly (fake_quant_fp8 with round_scale, fake_quant_fp4), so a
row the model's QAT already put on this grid packs and unpacks to itself bit for bit (tests/test_kv_formats.py):
with QAT on, the FP8 cache changes no logit. Without QAT the packing rounds (its error: docs/kernels.md).

`PackedStore` is a pool tensor of records that reads and writes like the value tensor it stands for: indexing
returns unpacked rows in the compute dtype, assignment packs. The Triton kernels read the records directly
(kernels/kv_formats_triton.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import call
from .quant import (FP4_E2M1_MAX, _blocks, _fp4_scaled, _fp8_scaled, e2m1_decode, e2m1_encode, e8m0_to_float,
                    float_to_e8m0, pack_fp4, unpack_fp4)


@dataclass(frozen=True)
class KVFormat:
    kind: str                # "fp8" | "fp4"
    width: int               # values per row
    block: int               # channels per scale
    tail: int = 0            # fp8: trailing channels kept in bf16 (V4's RoPE slice)
    scale: str = "ue8m0"     # fp4: "ue8m0" | "e4m3" scale bytes (fp8 is always ue8m0)

    def __post_init__(self):
        if self.kind not in ("fp8", "fp4") or self.scale not in ("ue8m0", "e4m3"):
            raise ValueError(f"KVFormat: kind {self.kind!r} / scale {self.scale!r} not known")
        if self.kind == "fp4" and (self.tail or self.width % 2):
            raise ValueError(f"KVFormat: fp4 records hold an even width and no tail (got width {self.width}, "
                             f"tail {self.tail})")
        if not 0 <= self.tail < self.width or self.quantized % self.block:
            raise ValueError(f"KVFormat: {self.quantized} quantized channels do not split into blocks of {self.block}")

    @classmethod
    def fitting(cls, *args, **kw) -> "KVFormat | None":
        """The format, or None when the widths do not fit it (a model of other widths keeps compute-dtype rows;
        kv_cache_dtype="fp8" is then refused in one line by the pools)."""
        try:
            return cls(*args, **kw)
        except ValueError:
            return None

    @property
    def quantized(self) -> int:
        """Channels on the 8- or 4-bit grid (the rest: the bf16 tail)."""
        return self.width - self.tail

    @property
    def tail_offset(self) -> int:
        return self.quantized if self.kind == "fp8" else self.width // 2

    @property
    def scale_offset(self) -> int:
        return self.tail_offset + 2 * self.tail

    @property
    def record_bytes(self) -> int:
        end = self.scale_offset + self.quantized // self.block
        return -(-end // 4) * 4

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., width] float -> records uint8 [..., record_bytes]."""
        if x.shape[-1] != self.width:
            raise ValueError(f"KVFormat.pack: rows of {x.shape[-1]} values, the format holds {self.width}")
        lead = x.shape[:-1]
        out = torch.zeros(*lead, self.record_bytes, dtype=torch.uint8, device=x.device)
        xb = _blocks(x[..., :self.quantized], self.block)                              # [..., nb, block] fp32
        if self.kind == "fp8":
            q, scale = _fp8_scaled(xb)                                                 # fake_quant_fp8's rule
            out[..., :self.quantized] = q.flatten(-2).view(torch.uint8)
            if self.tail:
                tail = x[..., self.quantized:].to(torch.bfloat16).contiguous().view(torch.uint8)
                out[..., self.tail_offset:self.scale_offset] = tail
            scale_bytes = float_to_e8m0(scale.squeeze(-1), check=False)
        else:
            q, scale = _fp4_scaled(xb, self.scale)
            if self.scale == "e4m3":
                q, scale = _exact_e4m3_scale(xb, q, scale)
            out[..., :self.tail_offset] = pack_fp4(e2m1_encode(q).flatten(-2)).view(torch.uint8)
            scale = scale.squeeze(-1)
            scale_bytes = float_to_e8m0(scale, check=False) if self.scale == "ue8m0" else \
                scale.to(torch.float8_e4m3fn).view(torch.uint8)
        out[..., self.scale_offset:self.scale_offset + scale_bytes.shape[-1]] = scale_bytes
        return out

    def unpack(self, rec: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """records uint8 [..., record_bytes] -> values [..., width] in `dtype`."""
        nb = self.quantized // self.block
        sb = rec[..., self.scale_offset:self.scale_offset + nb]
        if self.kind == "fp8" or self.scale == "ue8m0":
            scale = e8m0_to_float(sb)
        else:
            scale = sb.contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        if self.kind == "fp8":
            vals = rec[..., :self.quantized].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
        else:
            vals = e2m1_decode(unpack_fp4(rec[..., :self.tail_offset].contiguous()))
        out = (vals.unflatten(-1, (nb, self.block)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)
        if self.tail:
            tail = rec[..., self.tail_offset:self.scale_offset].contiguous().view(torch.bfloat16).to(dtype)
            out = torch.cat([out, tail], dim=-1)
        return out


def _exact_e4m3_scale(xb: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, tries: int = 4):
    """FP4 with e4m3 scales: a block already on an e2m1 x e4m3 grid (the QAT's output) keeps its values. The rule's
    scale, e4m3(amax / 6), recomputed from rounded values can land one or more e4m3 steps below the original where
    the scale is an e4m3 subnormal (amax < 6 * 2^-6); the next few e4m3 values up are tried and the first that
    reproduces the block exactly is kept (the rule's own scale when none does: a block not on the grid)."""
    best_q, best = q, scale
    found = (e2m1_decode(e2m1_encode(q)) * scale == xb).all(-1, keepdim=True)
    s = scale
    for _ in range(tries):
        code = s.to(torch.float8_e4m3fn).view(torch.uint8)
        s = (code + (code < 0x7E).to(torch.uint8)).view(torch.float8_e4m3fn).to(torch.float32)
        qs = (xb / s).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX)
        exact = (e2m1_decode(e2m1_encode(qs)) * s == xb).all(-1, keepdim=True) & ~found
        best_q, best = torch.where(exact, qs, best_q), torch.where(exact, s, best)
        found |= exact
    return best_q, best


# The release's layouts (docs/kernels.md, "FP8 KV cache").
V4_LATENT = KVFormat("fp8", 512, 64, tail=64)
V41_WINDOW = KVFormat("fp8", 512, 32)
V41_ENTRY = KVFormat("fp4", 512, 16, scale="e4m3")
INDEX_KEY = KVFormat("fp4", 128, 32)
assert (V4_LATENT.record_bytes, V41_WINDOW.record_bytes, V41_ENTRY.record_bytes, INDEX_KEY.record_bytes) == \
    (584, 528, 288, 68)
assert FP4_E2M1_MAX == 6.0


class PackedStore:
    """A pool of packed records, data uint8 [..., record_bytes], that reads and writes as values [..., width] in
    `dtype`: store[i] unpacks the rows i names, store[i] = v packs v. `flatten` views the records."""

    def __init__(self, data: torch.Tensor, fmt: KVFormat, dtype: torch.dtype):
        if data.dtype != torch.uint8 or data.shape[-1] != fmt.record_bytes:
            raise ValueError(f"PackedStore: data must be uint8 [..., {fmt.record_bytes}], got {data.dtype} "
                             f"{tuple(data.shape)}")
        self.data, self.fmt, self.dtype = data, fmt, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.fmt.width))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def flatten(self, start: int, end: int) -> "PackedStore":
        if end < 0:
            end += self.dim()
        if end >= self.dim() - 1:
            raise ValueError("PackedStore.flatten: the record dimension stays")
        return PackedStore(self.data.flatten(start, end), self.fmt, self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return self.fmt.unpack(self.data[index], self.dtype)

    def __setitem__(self, index, values: torch.Tensor) -> None:
        self.data[index] = kv_pack(self.fmt, values)

    def __repr__(self) -> str:
        return f"PackedStore({self.fmt.kind}, {tuple(self.shape)}, {self.fmt.record_bytes} B a row)"


def kv_pack(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """x [..., width] -> records uint8 [..., record_bytes] (the op: the reference's KVFormat.pack, or the Triton
    packer, byte for byte the same)."""
    return call("kv_pack")(fmt, x)


def _kv_pack(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    return fmt.pack(x)


def raw(store) -> torch.Tensor:
    """The tensor a store keeps its bytes in (a PackedStore's records, else the store itself)."""
    return store.data if isinstance(store, PackedStore) else store
