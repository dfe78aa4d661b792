"""FP4 A16 expert GEMM variants with the weights as the MMA's A operand ("swap AB": acc^T [BN, BM] = W x^T) and an
elementwise decode (even-k and odd-k halves of each packed byte as two dots, no interleave), so the decoded weights
can stay in registers as a wgmma register operand instead of going through shared memory as bf16.
Knobs: LUT (PTX byte-table decode), BCAST (scale loaded [BN, BK/32] and broadcast, else gathered per byte),
PREFETCH (next K step's bytes loaded before this step's dots)."""
import triton
import triton.language as tl
import torch

from deepinfer.kernels.experts_triton import _FP4_LUT_ASM, _fp4_load, _fp4_lut_tile, tile_table
from deepinfer.kernels.quant_triton import e2m1_over_2p14


@triton.jit
def _load(w_ptr, s_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN: tl.constexpr, BK: tl.constexpr,
          BCAST: tl.constexpr):
    nmask = rn < N
    kb = k0 // 2 + tl.arange(0, BK // 2)
    m = nmask[:, None] & (kb < K // 2)[None, :]
    packed = tl.load(w_ptr + e * swe + rn[:, None] * swn + kb[None, :], mask=m, other=0)
    if BCAST:
        ks = k0 // 32 + tl.arange(0, BK // 32)
        s = tl.load(s_ptr + e * sse + rn[:, None] * ssn + ks[None, :],
                    mask=nmask[:, None] & (ks < K // 32)[None, :], other=127)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // 32, 16)), (BN, BK // 2))
    else:
        s = tl.load(s_ptr + e * sse + rn[:, None] * ssn + (kb // 16)[None, :], mask=m, other=127)
    return packed, s


@triton.jit
def _decode(packed, s, LUT: tl.constexpr, OUT: tl.constexpr):
    """packed [BN, BK/2] bytes, s [BN, BK/2] their e8m0 -> (even-k, odd-k) bf16 [BN, BK/2] each."""
    if LUT:
        even, odd = tl.inline_asm_elementwise(_FP4_LUT_ASM, "=r,=r,=r,=r,r,r", [packed, s],
                                              dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return even, odd
    p = packed.to(tl.int32)
    mult = ((s.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    return (e2m1_over_2p14(p & 0xF) * mult).to(OUT), (e2m1_over_2p14(p >> 4) * mult).to(OUT)


@triton.jit
def _swap_gemm(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, r_ptr, out_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
               stride_xm, stride_om, swe, swn, sse, ssn, limit,
               N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, LUT: tl.constexpr, BCAST: tl.constexpr, PREFETCH: tl.constexpr):
    t = tl.program_id(0)
    rows = tl.load(tile_rows_ptr + t)
    if rows == 0:
        return
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + t).to(tl.int64)
    rm = tl.arange(0, BM)
    mmask = rm < rows
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc1 = tl.zeros((BN, BM), dtype=tl.float32)
    acc3 = tl.zeros((BN, BM), dtype=tl.float32)
    p1, q1 = _load(w1_ptr, s1_ptr, e, rn, 0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
    p3, q3 = p1, q1
    if GATED:
        p3, q3 = _load(w3_ptr, s3_ptr, e, rn, 0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
    for k0 in range(0, K, BK):
        if PREFETCH:     # next step's bytes in flight while this step decodes and multiplies (past K: masked)
            n1, m1 = _load(w1_ptr, s1_ptr, e, rn, k0 + BK, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
            n3, m3 = n1, m1
            if GATED:
                n3, m3 = _load(w3_ptr, s3_ptr, e, rn, k0 + BK, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
        else:
            if k0 > 0:
                p1, q1 = _load(w1_ptr, s1_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
                if GATED:
                    p3, q3 = _load(w3_ptr, s3_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
        kh = k0 + 2 * tl.arange(0, BK // 2)
        xm = mmask[None, :] & (kh < K)[:, None]
        xe = tl.load(x_ptr + (row0 + rm)[None, :] * stride_xm + kh[:, None], mask=xm, other=0.0)      # [BK/2, BM]
        xo = tl.load(x_ptr + (row0 + rm)[None, :] * stride_xm + kh[:, None] + 1, mask=xm, other=0.0)
        ev, od = _decode(p1, q1, LUT, x_ptr.dtype.element_ty)
        acc1 = tl.dot(ev, xe, acc1)
        acc1 = tl.dot(od, xo, acc1)
        if GATED:
            ev3, od3 = _decode(p3, q3, LUT, x_ptr.dtype.element_ty)
            acc3 = tl.dot(ev3, xe, acc3)
            acc3 = tl.dot(od3, xo, acc3)
        if PREFETCH:
            p1, q1 = n1, m1
            if GATED:
                p3, q3 = n3, m3
    omask = (rn < N)[:, None] & mmask[None, :]
    optr = out_ptr + (row0 + rm)[None, :] * stride_om + rn[:, None]
    if GATED:
        gate = acc1.to(x_ptr.dtype.element_ty).to(tl.float32)
        up = acc3.to(x_ptr.dtype.element_ty).to(tl.float32)
        if limit > 0:
            gate = tl.minimum(gate, limit)
            up = tl.clamp(up, -limit, limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        r = tl.load(r_ptr + row0 + rm, mask=mmask, other=0.0).to(tl.float32)
        tl.store(optr, (h * r[None, :]).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(optr, acc1.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=omask)


def _launch(x, w, s, w3, s3, r, out, table, n, k, gated, limit, bn, bk, warps, stages, lut, bcast, prefetch,
            kind="swap"):
    expert, row0, rows = table
    grid = (rows.shape[0], triton.cdiv(n, bn))
    KERNELS[kind][grid](x, w, s, w3 if w3 is not None else w, s3 if s3 is not None else s, r, out, expert, row0, rows,
                     x.stride(0), out.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), float(limit),
                     N=n, K=k, GATED=gated, BM=16, BN=bn, BK=bk, LUT=lut, BCAST=bcast, PREFETCH=prefetch,
                     num_warps=warps, num_stages=stages)


def run(x, offsets, route_weights, ew, bn=64, bk=128, warps=4, stages=1, lut=True, bcast=False, prefetch=False,
        kind="swap"):
    """experts_triton.run's contract (x grouped by expert, [M, D] -> [M, D] fp32) on the swap-AB kernel; FP4 A16."""
    m = x.shape[0]
    x = x.contiguous()
    table = tile_table(offsets, 16, m)
    s1, s2, s3 = ew.scales
    h = torch.empty(m, ew.inter, dtype=ew.dtype, device=x.device)
    _launch(x, ew.w1, s1, ew.w3, s3, route_weights.contiguous(), h, table, ew.inter, ew.dim, True, ew.limit,
            bn, bk, warps, stages, lut, bcast, prefetch, kind)
    y = torch.empty(m, ew.dim, dtype=torch.float32, device=x.device)
    _launch(h, ew.w2, s2, None, None, route_weights, y, table, ew.dim, ew.inter, False, ew.limit,
            bn, bk, warps, stages, lut, bcast, prefetch, kind)
    return y


@triton.jit
def _split_gemm(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, r_ptr, out_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
                stride_xm, stride_om, swe, swn, sse, ssn, limit,
                N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, LUT: tl.constexpr, BCAST: tl.constexpr, PREFETCH: tl.constexpr):
    """The repo kernel's orientation (acc [BM, BN] = x W^T, x the A operand) with the elementwise decode: x's even-k
    and odd-k halves times the decoded even / odd weight halves, and the optional register prefetch."""
    t = tl.program_id(0)
    rows = tl.load(tile_rows_ptr + t)
    if rows == 0:
        return
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + t).to(tl.int64)
    rm = tl.arange(0, BM)
    mmask = rm < rows
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    p1, q1 = _load(w1_ptr, s1_ptr, e, rn, 0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
    p3, q3 = p1, q1
    if GATED:
        p3, q3 = _load(w3_ptr, s3_ptr, e, rn, 0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
    for k0 in range(0, K, BK):
        if PREFETCH:
            n1, m1 = _load(w1_ptr, s1_ptr, e, rn, k0 + BK, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
            n3, m3 = n1, m1
            if GATED:
                n3, m3 = _load(w3_ptr, s3_ptr, e, rn, k0 + BK, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
        else:
            if k0 > 0:
                p1, q1 = _load(w1_ptr, s1_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
                if GATED:
                    p3, q3 = _load(w3_ptr, s3_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK, BCAST)
        kh = k0 + 2 * tl.arange(0, BK // 2)
        xm = mmask[:, None] & (kh < K)[None, :]
        xe = tl.load(x_ptr + (row0 + rm)[:, None] * stride_xm + kh[None, :], mask=xm, other=0.0)      # [BM, BK/2]
        xo = tl.load(x_ptr + (row0 + rm)[:, None] * stride_xm + kh[None, :] + 1, mask=xm, other=0.0)
        ev, od = _decode(p1, q1, LUT, x_ptr.dtype.element_ty)
        acc1 = tl.dot(xe, tl.trans(ev), acc1)
        acc1 = tl.dot(xo, tl.trans(od), acc1)
        if GATED:
            ev3, od3 = _decode(p3, q3, LUT, x_ptr.dtype.element_ty)
            acc3 = tl.dot(xe, tl.trans(ev3), acc3)
            acc3 = tl.dot(xo, tl.trans(od3), acc3)
        if PREFETCH:
            p1, q1 = n1, m1
            if GATED:
                p3, q3 = n3, m3
    omask = mmask[:, None] & (rn < N)[None, :]
    optr = out_ptr + (row0 + rm)[:, None] * stride_om + rn[None, :]
    if GATED:
        gate = acc1.to(x_ptr.dtype.element_ty).to(tl.float32)
        up = acc3.to(x_ptr.dtype.element_ty).to(tl.float32)
        if limit > 0:
            gate = tl.minimum(gate, limit)
            up = tl.clamp(up, -limit, limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        r = tl.load(r_ptr + row0 + rm, mask=mmask, other=0.0).to(tl.float32)
        tl.store(optr, (h * r[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(optr, acc1.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=omask)




@triton.jit
def _cur_gemm(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, r_ptr, out_ptr, tile_expert_ptr, tile_row0_ptr, tile_rows_ptr,
              stride_xm, stride_om, swe, swn, sse, ssn, limit,
              N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, LUT: tl.constexpr, BCAST: tl.constexpr, PREFETCH: tl.constexpr):
    """The repo kernel's FP4 A16 byte-table path (interleaved decode, x the A operand) with the register prefetch
    (LUT must be on: the interpreter cannot run this one; BCAST unused)."""
    t = tl.program_id(0)
    rows = tl.load(tile_rows_ptr + t)
    if rows == 0:
        return
    e = tl.load(tile_expert_ptr + t).to(tl.int64)
    row0 = tl.load(tile_row0_ptr + t).to(tl.int64)
    rm = tl.arange(0, BM)
    mmask = rm < rows
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    p1, q1 = _fp4_load(w1_ptr, s1_ptr, e, rn, 0, N, K, swe, swn, sse, ssn, BN, BK)
    p3, q3 = p1, q1
    if GATED:
        p3, q3 = _fp4_load(w3_ptr, s3_ptr, e, rn, 0, N, K, swe, swn, sse, ssn, BN, BK)
    for k0 in range(0, K, BK):
        if PREFETCH:
            n1, m1 = _fp4_load(w1_ptr, s1_ptr, e, rn, k0 + BK, N, K, swe, swn, sse, ssn, BN, BK)
            n3, m3 = n1, m1
            if GATED:
                n3, m3 = _fp4_load(w3_ptr, s3_ptr, e, rn, k0 + BK, N, K, swe, swn, sse, ssn, BN, BK)
        else:
            if k0 > 0:
                p1, q1 = _fp4_load(w1_ptr, s1_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK)
                if GATED:
                    p3, q3 = _fp4_load(w3_ptr, s3_ptr, e, rn, k0, N, K, swe, swn, sse, ssn, BN, BK)
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + (row0 + rm)[:, None] * stride_xm + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :],
                    other=0.0)
        acc1 = tl.dot(x, tl.trans(_fp4_lut_tile(p1, q1, BN, BK)), acc1)
        if GATED:
            acc3 = tl.dot(x, tl.trans(_fp4_lut_tile(p3, q3, BN, BK)), acc3)
        if PREFETCH:
            p1, q1 = n1, m1
            if GATED:
                p3, q3 = n3, m3
    omask = mmask[:, None] & (rn < N)[None, :]
    optr = out_ptr + (row0 + rm)[:, None] * stride_om + rn[None, :]
    if GATED:
        gate = acc1.to(x_ptr.dtype.element_ty).to(tl.float32)
        up = acc3.to(x_ptr.dtype.element_ty).to(tl.float32)
        if limit > 0:
            gate = tl.minimum(gate, limit)
            up = tl.clamp(up, -limit, limit)
        h = gate / (1.0 + tl.exp(-gate)) * up
        r = tl.load(r_ptr + row0 + rm, mask=mmask, other=0.0).to(tl.float32)
        tl.store(optr, (h * r[:, None]).to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(optr, acc1.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=omask)


KERNELS = {"swap": _swap_gemm, "split": _split_gemm, "cur": _cur_gemm}
