"""Triton grouped expert GEMMs: `grouped_experts` for the `triton` and `triton_invariant` backend sets.

The rows arrive grouped by expert (kernels/experts.py). They are cut into expert-aligned tiles of BM rows (a tile
holds rows of one expert; `tile_table` builds the table on the device, static size, no host sync) and two kernel
launches do the MLP, each program one (tile, BN output columns) block streaming its expert's weights along K:

    gate_up   h[j] = r[j] * swiglu(w1[e] x[j], w3[e] x[j], limit)    both GEMMs in one pass over x, the clamp,
                                                                    SwiGLU and routing weight in the epilogue;
                                                                    h stored in the compute dtype
    down      y[j] = w2[e] h[j]                                      fp32 out; the dispatcher's combine sums each
                                                                    row's k outputs in a fixed order

Weights stay as stored and are decoded in registers tile by tile:
    dense  loaded as they are (bf16 / fp16)
    fp4    e2m1 nibbles (low = even element) -> fp16 bits (sign << 15 | magnitude << 9 is the value / 2^14,
           subnormal for 0.5) -> fp32, times 2^(s - 127 + 14) per 32-block (s the e8m0 byte: exact)
    fp8    e4m3 with one fp32 scale per 128x128 block
and, by `ExpertWeights.act_fp8`, fed to the MMA as:
    A16    weights decoded to the compute dtype, tl.dot(x, w) with fp32 accumulation (W4A16, what transformers does)
    A8     x quantized per 1x128 to e4m3 in the kernel (power-of-two scale, quant.fake_quant_fp8's rule), FP8 MMA
           per 128-wide K step, partial sums scaled by the activation and weight scales. FP4 weights become e4m3
           with their per-32 scales folded in before the MMA: per (row, 128-block) a reference exponent
           ref = max(s) - 6 is kept for after the MMA and each 32-block's value is e2m1 * 2^(s - ref), exact in
           e4m3 while the block's scales span <= 2^14 (smaller ones lose bits as e4m3 subnormals; documented).
           With DECODE tiles on the GPU, W4A8 instead goes through tl.dot_scaled (e4m3 x with its power-of-two
           scale as e8m0, e2m1 weights with their e8m0 scales: the same products, no fold): measured faster there,
           slower for prefill and for A16 (docs/kernels.md).

FP4 weights held in triton_kernels' Hopper layout (an engine on sm_90 with triton_kernels installed converts them
at build: `Experts.relayout`) go through its `matmul_ogs` instead (kernels/experts_ogs_triton.py), both sets; where
that cannot run, the reference backends read that layout.

Tile configurations (BM, BN, BK, warps, stages) come from the shapes only: `DECODE` while the rows average <= 4 per
expert, else `PREFILL`; `triton_invariant` uses `INVARIANT` whatever the rows, so a row's result never depends on
what shares its batch. Everything else (fp32 / float64 models, CPU tensors outside Triton's interpreter, a missing
Triton) runs the reference backend: the op's result is the same recipe either way
(tests/test_kernels_experts_triton.py, tests/interpreted/test_experts_triton.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import experts_ogs as ogs
from .experts import FP8_ACT_BLOCK, ExpertWeights, _invariant, _reference, _swiglu, expert_tiles, tile_count
from .gpu import is_interpreted, pow2, sm_count
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:       # CPU machines without Triton: the reference backend serves these sets
    triton = None
else:
    from . import experts_ogs_triton as ogs_triton
    from .quant_triton import e2m1_over_2p14, quant_tile, to_e4m3


@dataclass(frozen=True)
class Tiles:
    """One kernel configuration: rows per tile, output columns and K per step, warps, pipeline stages."""
    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    min_bn: int = 16          # narrower column blocks (down to this) while the grid would leave SMs idle
    lut_fp4: bool = False     # A16 FP4 decode through PTX byte tables (prmt) on the GPU (not in the interpreter)
    native_fp4_a8: bool = False  # W4A8 through tl.dot_scaled (Triton's e2m1 x e8m0 path) on the GPU instead of
                                 # the in-kernel decode + fold (never in the interpreter: it cannot run dot_scaled)


# lut_fp4: the byte-table FP4 decode, measured on the H200 19-30% faster than the nibble arithmetic at
# 1-256 tokens (V4.1 shapes; the same outputs); the interpreter runs the arithmetic one
DECODE = Tiles(bm=16, bn=64, bk=128, warps=4, stages=4, native_fp4_a8=True, lut_fp4=True)   # docs/kernels.md
PREFILL = Tiles(bm=64, bn=128, bk=128, warps=8, stages=3, lut_fp4=True)
# Batch-invariant: one configuration per weight format whatever the rows (BN never narrows). FP4: DECODE's BM 16
# tiles, so decode-sized batches run as fast as the default (BM 64 took 1.4-2.0x at 1-256 tokens) and
# an 8k prefill's experts take 1.6x PREFILL's; bf16 / FP8 weights keep BM 64 (within 1.06x of DECODE at decode).
INVARIANT = Tiles(bm=64, bn=64, bk=128, warps=4, stages=4, min_bn=64, lut_fp4=True)
INVARIANT_FP4 = Tiles(bm=16, bn=64, bk=128, warps=4, stages=4, min_bn=64, lut_fp4=True)
PROGRAMS_PER_SM = 2           # the grid is made at least this many programs per SM where BN allows
DECODE_ROWS_PER_EXPERT = 4    # DECODE while rows <= 4 * experts


def interpreting() -> bool:
    """Whether the kernels were built by Triton's interpreter (decided when Triton decorated them, at import)."""
    return triton is not None and is_interpreted(_expert_gemm)


def supported(x: torch.Tensor, ew: ExpertWeights) -> bool:
    """Whether the Triton kernels take this call (else the reference backend does)."""
    if triton is None or not (x.is_cuda or interpreting()):
        return False
    if ew.dtype not in (torch.bfloat16, torch.float16) and not (interpreting() and ew.dtype == torch.float32):
        return False
    if ew.fmt == "dense" and ew.w1.dtype != ew.dtype:
        return False
    if ew.fmt == "fp4" and (ew.dim % 32 or ew.inter % 32 or ew.layout != ogs.ROWS):
        return False
    return True


def tile_table(offsets: torch.Tensor, bm: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`experts.expert_tiles` as the kernels read them: int32 [T] each, the tile's expert, its first sorted row and
    its row count (0: an unused tile past the last expert's tiles). On the kernels' device one launch
    (`_tile_table_kernel`) where the torch formulation (`_tile_table`) takes about 23."""
    n_experts = offsets.shape[0] - 1
    if triton is None or not (offsets.is_cuda or interpreting()) or n_experts > TILE_TABLE_EXPERTS:
        return _tile_table(offsets, bm, n_rows)
    n_tiles = tile_count(n_rows, n_experts, bm)
    out = torch.empty((3, n_tiles), dtype=torch.int32, device=offsets.device)
    _tile_table_kernel[(triton.cdiv(n_tiles, TILE_BLOCK),)](
        offsets.contiguous(), out, n_tiles, n_experts, max(n_rows - 1, 0), BM=bm, BLOCK_T=TILE_BLOCK,
        BINS=pow2(n_experts, 16), num_warps=4, **pdl(offsets.device))
    return out[0], out[1], out[2]


def _tile_table(offsets: torch.Tensor, bm: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tile_start, tile_end, expert = expert_tiles(offsets, bm, n_rows)
    t = torch.arange(expert.shape[0], device=offsets.device)
    row0 = offsets[expert] + (t - tile_start[expert]) * bm
    rows = (offsets[expert + 1] - row0).clamp_(min=0, max=bm)
    rows = torch.where(t < tile_end[-1], rows, torch.zeros_like(rows))
    return expert.to(torch.int32), row0.clamp_(max=max(n_rows - 1, 0)).to(torch.int32), rows.to(torch.int32)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`experts.swiglu` in one launch (torch takes four to six: the casts, the clamps, silu, the product), fp32 out,
    through matmul_ogs's activation kernel without its routing weight (kernels/experts_ogs_triton.py). silu through
    the kernels' exp, so within an ulp or two of torch's, not its bits."""
    if triton is None or not (gate.is_cuda or interpreting()) or gate.dim() != 2 or gate.shape != up.shape \
            or torch.float64 in (gate.dtype, up.dtype) or gate.stride(1) != 1 or up.stride(1) != 1:
        return _swiglu(gate, up, limit)
    return ogs_triton.gated_activation(gate, up, None, limit, torch.float32)


TILE_BLOCK = 16              # tiles a tile-table program fills
TILE_TABLE_EXPERTS = 1024    # experts a tile-table program holds (every program reads all of their counts)

if triton is not None:

    @triton.jit
    def _tile_table_kernel(offsets_ptr, out_ptr, T, E, last_row, BM: tl.constexpr, BLOCK_T: tl.constexpr,
                           BINS: tl.constexpr, PDL: tl.constexpr):
        """out [3, T] int32 (expert, row0, rows) of tiles [pid * BLOCK_T, +BLOCK_T), as `_tile_table`: each
        program counts every expert's tiles (offsets [E+1], E <= BINS), finds a tile's expert as searchsorted's
        right side over the inclusive tile ends (clamped to E - 1) and picks that expert's values by a masked
        sum over the experts (integers: exact)."""
        await_inputs(PDL)
        e = tl.arange(0, BINS)
        e_ok = e < E
        lo = tl.load(offsets_ptr + e, mask=e_ok, other=0).to(tl.int32)          # [BINS] offsets[e]
        hi = tl.load(offsets_ptr + e + 1, mask=e_ok, other=0).to(tl.int32)      # offsets[e + 1]
        tiles = (hi - lo + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)                                          # inclusive; padding adds 0
        total = tl.sum(tiles, 0)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ended = (tile_end[None, :] <= t[:, None]) & e_ok[None, :]               # [BLOCK_T, BINS]
        expert = tl.minimum(tl.sum(ended.to(tl.int32), 1), E - 1)
        pick = e[None, :] == expert[:, None]
        first = tl.sum(tl.where(pick, lo[None, :], 0), 1)                       # offsets[expert]
        end = tl.sum(tl.where(pick, hi[None, :], 0), 1)                         # offsets[expert + 1]
        start = tl.sum(tl.where(pick, (tile_end - tiles)[None, :], 0), 1)       # tile_start[expert]
        row0 = first + (t - start) * BM
        rows = tl.where(t < total, tl.minimum(tl.maximum(end - row0, 0), BM), 0)
        ok = t < T
        tl.store(out_ptr + t, expert, mask=ok)
        tl.store(out_ptr + T + t, tl.minimum(row0, last_row), mask=ok)
        tl.store(out_ptr + 2 * T + t, rows, mask=ok)


if triton is not None:

    # e2m1 -> bf16 through byte lookup tables (PTX prmt), 4 packed bytes (8 values) per instance: magnitude codes
    # select the bf16 low / high bytes from 8-entry tables, the sign bytes come from prmt's sign-replicate mode,
    # the two outputs are the even (low-nibble) and odd (high-nibble) values, each times the block's e8m0 scale
    # (bf16 2^(s-127), exact) in one bf16x2 multiply per pair. About 2.5 instructions per value.
    _FP4_LUT_ASM = tl.constexpr("""
    {
    .reg .b32 la, lb, ha, hb, s0, s1, l0, h0, l1, h1, sh, g0, g1, sc, sc2;
    mov.b32 la, 0xC0800000; mov.b32 lb, 0xC0804000;
    mov.b32 ha, 0x3F3F3F00; mov.b32 hb, 0x40404040;
    and.b32 s0, $4, 0x7777;
    shr.b32 s1, $4, 16;
    and.b32 s1, s1, 0x7777;
    prmt.b32 l0, la, lb, s0; prmt.b32 h0, ha, hb, s0;
    prmt.b32 l1, la, lb, s1; prmt.b32 h1, ha, hb, s1;
    shl.b32 sh, $4, 4;
    prmt.b32 g0, sh, $4, 0xD9C8; prmt.b32 g1, sh, $4, 0xFBEA;
    and.b32 g0, g0, 0x80808080; or.b32 h0, h0, g0;
    and.b32 g1, g1, 0x80808080; or.b32 h1, h1, g1;
    and.b32 sc, $5, 0xFF; shl.b32 sc, sc, 7; shl.b32 sc2, sc, 16; or.b32 sc2, sc2, sc;
    prmt.b32 $0, l0, h0, 0x6240; prmt.b32 $1, l1, h1, 0x6240;
    prmt.b32 $2, l0, h0, 0x7351; prmt.b32 $3, l1, h1, 0x7351;
    mul.rn.bf16x2 $0, $0, sc2; mul.rn.bf16x2 $1, $1, sc2;
    mul.rn.bf16x2 $2, $2, sc2; mul.rn.bf16x2 $3, $3, sc2;
    }
    """)

    @triton.jit
    def _fp4_load(w_ptr, s_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN: tl.constexpr, BK: tl.constexpr):
        """Expert e's FP4 rows rn [BN], columns k0..k0+BK as stored: (packed uint8 [BN, BK/2], e8m0 uint8
        [BN, BK/32]); rows past N and columns past K read as 0 codes with scale 2^0."""
        nmask = rn < N
        kb = k0 // 2 + tl.arange(0, BK // 2)
        packed = tl.load(w_ptr + e * swe + rn[:, None] * swn + kb[None, :],
                         mask=nmask[:, None] & (kb < K // 2)[None, :], other=0)
        ks = k0 // 32 + tl.arange(0, BK // 32)
        s = tl.load(s_ptr + e * sse + rn[:, None] * ssn + ks[None, :],
                    mask=nmask[:, None] & (ks < K // 32)[None, :], other=127)
        return packed, s

    @triton.jit
    def _fp4_lut_tile(packed, s, BN: tl.constexpr, BK: tl.constexpr):
        """FP4 tile (packed [BN, BK/2], e8m0 [BN, BK/32]) -> bf16 [BN, BK] through the byte tables above (GPU
        only)."""
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))  # one per byte
        even, odd = tl.inline_asm_elementwise(_FP4_LUT_ASM, "=r,=r,=r,=r,r,r", [packed, s],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return tl.reshape(tl.join(even, odd), (BN, BK))

    @triton.jit
    def _weight_tile(w_ptr, s_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, ssk,
                     WFMT: tl.constexpr, A8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, OUT: tl.constexpr,
                     EXACT: tl.constexpr, LUT: tl.constexpr):
        """Expert e's weight rows rn [BN], columns k0..k0+BK -> (tile [BN, BK] for the MMA, post-scale [BN] fp32).
        WFMT 0 dense, 1 fp4 (bytes [N, K/2], e8m0 [N, K/32]), 2 fp8 (e4m3 [N, K], fp32 [N/128, K/128]).
        A16: the tile in OUT (the compute dtype), post-scale 1. A8: the tile in e4m3 (fp4 scales folded in)."""
        nmask = rn < N
        if WFMT == 1:
            packed, s = _fp4_load(w_ptr, s_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK)
            if LUT and not A8:
                return _fp4_lut_tile(packed, s, BN, BK), tl.full((BN,), 1.0, tl.float32)
            packed, s = packed.to(tl.int32), s.to(tl.int32)                      # [BN, BK/2], [BN, BK/32]
            codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BN, BK))      # interleave: even, odd
            if A8:
                ref = tl.max(s, axis=1) - 6                                       # [BN]
                mult = ((s - ref[:, None] + 14 + 127) << 23).to(tl.float32, bitcast=True)   # 2^(s - ref + 14)
                post = tl.exp2((ref - 127).to(tl.float32))
            else:
                mult = ((s + 14) << 23).to(tl.float32, bitcast=True)              # 2^(s - 127 + 14)
                post = tl.full((BN,), 1.0, tl.float32)
            v = e2m1_over_2p14(codes)                                             # [BN, BK]
            v = tl.reshape(tl.reshape(v, (BN, BK // 32, 32)) * mult[:, :, None], (BN, BK))
            if A8:
                return to_e4m3(v, EXACT), post
            else:
                return v.to(OUT), post
        elif WFMT == 2:
            rk = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + e * swe + rn[:, None] * swn + rk[None, :],
                        mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
            s = tl.load(s_ptr + e * sse + (rn // 128) * ssn + (k0 // 128) * ssk, mask=nmask, other=0.0)  # [BN]
            if A8:
                return w, s
            else:
                return (w.to(tl.float32) * s[:, None]).to(OUT), tl.full((BN,), 1.0, tl.float32)
        else:
            rk = k0 + tl.arange(0, BK)
            w = tl.load(w_ptr + e * swe + rn[:, None] * swn + rk[None, :],
                        mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
            return w, tl.full((BN,), 1.0, tl.float32)

    @triton.jit
    def _fp4_scaled_dot(acc, a, a_scale, w_ptr, s_ptr, e, rn, k0, N, K, swe, swn, sse, ssn,
                        BN: tl.constexpr, BK: tl.constexpr):
        """acc + a [BM, BK] (e4m3 with e8m0 scales a_scale [BM, BK/32]) times expert e's FP4 rows rn transposed,
        through tl.dot_scaled (the same math: exact products, fp32 accumulation)."""
        packed, s = _fp4_load(w_ptr, s_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK)
        return tl.dot_scaled(a, a_scale, "e4m3", tl.trans(packed), s, "e2m1", acc)

    @triton.jit
    def _expert_gemm(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, r_ptr, out_ptr,
                     tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                     stride_xm, stride_om, swe, swn, sse, ssn, ssk, limit,
                     N: tl.constexpr, K: tl.constexpr,
                     WFMT: tl.constexpr, A8: tl.constexpr, GATED: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr,
                     ROUND: tl.constexpr, NATIVE: tl.constexpr, LUT: tl.constexpr, PDL: tl.constexpr):
        """One (tile, BN columns) block. GATED: out = r * swiglu(x w1^T, x w3^T) in out's dtype; else
        out = x w1^T in fp32. x [M, K] rows of the tile's expert; w* [E, N, K] as stored."""
        await_inputs(PDL)
        t = tl.program_id(0)
        rows = tl.load(tile_rows_ptr + t)
        if rows == 0:
            return
        e = tl.load(tile_expert_ptr + t).to(tl.int64)
        row0 = tl.load(tile_row0_ptr + t).to(tl.int64)
        rm = tl.arange(0, BM)
        mmask = rm < rows
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        out_dtype = out_ptr.dtype.element_ty
        acc1 = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            rk = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + (row0 + rm)[:, None] * stride_xm + rk[None, :],
                        mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
            if WFMT == 1 and A8 and NATIVE:      # W4A8 through Triton's own e2m1 x e8m0 path (tl.dot_scaled)
                xq, xs = quant_tile(x.to(tl.float32), EXACT)
                xe8 = ((xs.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)     # 2^(b-127) exactly
                xe8 = tl.broadcast_to(xe8[:, None], (BM, BK // 32))
                acc1 = _fp4_scaled_dot(acc1, xq, xe8, w1_ptr, s1_ptr, e, rn, k0, N, K, swe, swn, sse, ssn,
                                       BN, BK)
                if GATED:
                    acc3 = _fp4_scaled_dot(acc3, xq, xe8, w3_ptr, s3_ptr, e, rn, k0, N, K, swe, swn, sse, ssn,
                                           BN, BK)
            else:
                w1, p1 = _weight_tile(w1_ptr, s1_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, ssk,
                                      WFMT, A8, BN, BK, x.dtype, EXACT, LUT)
                if A8:
                    xq, xs = quant_tile(x.to(tl.float32), EXACT)
                    acc1 += tl.dot(xq, tl.trans(w1)) * xs[:, None] * p1[None, :]
                else:
                    acc1 = tl.dot(x, tl.trans(w1), acc1)
                if GATED:
                    w3, p3 = _weight_tile(w3_ptr, s3_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, ssk,
                                          WFMT, A8, BN, BK, x.dtype, EXACT, LUT)
                    if A8:
                        acc3 += tl.dot(xq, tl.trans(w3)) * xs[:, None] * p3[None, :]
                    else:
                        acc3 = tl.dot(x, tl.trans(w3), acc3)
        omask = mmask[:, None] & (rn < N)[None, :]
        optr = out_ptr + (row0 + rm)[:, None] * stride_om + rn[None, :]
        if GATED:      # gate and up rounded to the GEMM dtype first, as the reference's GEMMs output them
            gate = acc1.to(ROUND).to(tl.float32)
            up = acc3.to(ROUND).to(tl.float32)
            if limit > 0:
                gate = tl.minimum(gate, limit)
                up = tl.clamp(up, -limit, limit)
            h = gate / (1.0 + tl.exp(-gate)) * up
            r = tl.load(r_ptr + row0 + rm, mask=mmask, other=0.0).to(tl.float32)
            tl.store(optr, (h * r[:, None]).to(out_dtype), mask=omask)
        else:          # y rounded to the GEMM dtype (as the reference's GEMM outputs it), stored fp32
            tl.store(optr, acc1.to(ROUND).to(out_dtype), mask=omask)


_TL_DTYPE = {} if triton is None else {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                                       torch.float32: tl.float32, torch.float64: tl.float32}


def column_block(n_tiles: int, n: int, tiles: Tiles, sms: int) -> int:
    """BN for a launch of n_tiles row tiles over n columns: the configuration's, halved (down to min_bn) while
    the grid has fewer than PROGRAMS_PER_SM programs per SM. Shapes only: the same for every batch of one size."""
    bn = tiles.bn
    while bn > tiles.min_bn and n_tiles * triton.cdiv(n, bn) < PROGRAMS_PER_SM * sms:
        bn //= 2
    return bn


def _launch(x, w1, s1, w3, s3, r, out, table, n, k, ew: ExpertWeights, gated: bool, tiles: Tiles):
    expert, row0, rows = table
    wfmt = {"dense": 0, "fp4": 1, "fp8": 2}[ew.fmt]
    bn = column_block(rows.shape[0], n, tiles, sm_count(x.device) or 1)
    # bf16 weights take twice the shared memory of a packed tile: halve K per step where the stages would not fit
    bk = tiles.bk // 2 if wfmt == 0 and bn * tiles.bk * tiles.stages > 128 * 128 * 2 else tiles.bk
    scale = s1 if s1 is not None else w1                       # an unused pointer for dense weights
    ss = scale.stride() if s1 is not None else (0, 0, 0)
    native = tiles.native_fp4_a8 and ew.act_fp8 and ew.dtype == torch.bfloat16 and not interpreting()
    lut = tiles.lut_fp4 and ew.dtype == torch.bfloat16 and not interpreting()
    grid = (rows.shape[0], triton.cdiv(n, bn))
    _expert_gemm[grid](x, w1, scale, w3 if w3 is not None else w1, s3 if s3 is not None else scale, r, out,
                       expert, row0, rows, x.stride(0), out.stride(0),
                       w1.stride(0), w1.stride(1), ss[0], ss[1], ss[2], float(ew.limit),
                       N=n, K=k, WFMT=wfmt, A8=ew.act_fp8, EXACT=interpreting(),
                       GATED=gated, BM=tiles.bm, BN=bn, BK=bk, ROUND=_TL_DTYPE[ew.gemm_dtype],
                       NATIVE=native, LUT=lut,
                       num_warps=tiles.warps, num_stages=tiles.stages, **pdl(x.device))


def run(x: torch.Tensor, offsets: torch.Tensor, route_weights: torch.Tensor, ew: ExpertWeights,
        tiles: Tiles) -> torch.Tensor:
    """Both launches over x [M, D] (compute dtype, grouped by expert) -> [M, D] fp32."""
    m = x.shape[0]
    if ew.act_fp8 and tiles.bk != FP8_ACT_BLOCK:
        raise ValueError(f"FP8 activations need K steps of {FP8_ACT_BLOCK} (one scale per step); got BK={tiles.bk}")
    x = x.contiguous()
    table = tile_table(offsets, tiles.bm, m)
    sc = ew.scales or (None, None, None)
    h = torch.empty(m, ew.inter, dtype=ew.dtype, device=x.device)
    _launch(x, ew.w1, sc[0], ew.w3, sc[2], route_weights.contiguous(), h, table, ew.inter, ew.dim, ew, True, tiles)
    y = torch.empty(m, ew.dim, dtype=torch.float32, device=x.device)
    _launch(h, ew.w2, sc[1], None, None, route_weights, y, table, ew.dim, ew.inter, ew, False, tiles)
    return y


def choose_tiles(m: int, ew: ExpertWeights) -> Tiles:
    """The default backend's configuration from the shapes: DECODE for few rows per expert, else PREFILL."""
    return DECODE if m <= DECODE_ROWS_PER_EXPERT * ew.n_experts else PREFILL


def _on_ogs(x, weights: ExpertWeights) -> bool:
    """Whether these rows go to triton_kernels' matmul_ogs: Hopper-layout weights it takes, on a device it runs on."""
    return bool(x.shape[0]) and weights.layout == ogs.HOPPER and ogs.fits(weights) and ogs.runs_on(x.device)


def _triton(x, expert_ids, offsets, route_weights, weights: ExpertWeights):
    x = x.to(weights.dtype)
    if _on_ogs(x, weights):
        return ogs_triton.run(x, offsets, route_weights, weights, invariant=False)
    if x.shape[0] == 0 or not supported(x, weights):
        return _reference(x, expert_ids, offsets, route_weights, weights)
    return run(x, offsets, route_weights, weights, choose_tiles(x.shape[0], weights))


def _triton_invariant(x, expert_ids, offsets, route_weights, weights: ExpertWeights):
    x = x.to(weights.dtype)
    if _on_ogs(x, weights):
        return ogs_triton.run(x, offsets, route_weights, weights, invariant=True)
    if x.shape[0] == 0 or not supported(x, weights):
        return _invariant(x, expert_ids, offsets, route_weights, weights)
    return run(x, offsets, route_weights, weights, invariant_tiles(weights))


def invariant_tiles(ew: ExpertWeights) -> Tiles:
    """triton_invariant's one configuration for these weights (by format only, never by rows)."""
    return INVARIANT_FP4 if ew.fmt == "fp4" else INVARIANT


__all__ = ["DECODE", "INVARIANT", "INVARIANT_FP4", "PREFILL", "Tiles", "choose_tiles", "invariant_tiles", "run",
           "supported", "swiglu_triton", "tile_table"]
