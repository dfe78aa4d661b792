"""Triton `route` and `permute` (the contracts: kernels/routing.py) for `triton` and `triton_invariant`.

  triton            route: one fused kernel per block of ROUTE_BLOCK_ROWS rows (fp32 logits on TF32x3 dots, score
                    fn, bias, k rounds of argmax, gather, normalize). The logits are a sum over fixed
                    ROUTE_CHUNK-column chunks; at decode (few row blocks) one program per (row block, chunk,
                    ROUTE_E_BLOCK experts) computes them first and the fused kernel adds the chunks in order (one
                    program walking the whole [E, D] router weight took 630-940 us a layer on an H200, one per
                    (row block, chunk) 80-107 us, with column blocks and TF32x3 16-24 us: docs/results.md); else
                    each program walks its chunks itself. The same arithmetic, but not the same bits with TF32x3
                    dots on the H200 (the tiles differ), so only `triton` picks by N. permute: a counting sort in
                    two kernels (per-block expert histograms; a sort of per-block unique keys + each block's base
                    offsets) and a few device-side cumsums in between: static shapes, no host sync, CUDA-graph
                    capturable.
  triton_invariant  the same route kernels, always through the chunk programs: their tile configuration depends
                    on E and D only, never on N, and each row is computed by the same instruction sequence wherever
                    it sits, so a row's bits do not depend on its batch (tests/test_kernels_routing.py checks it on
                    CUDA). permute has integer outputs: the `triton` one serves as it is.
The functions run the kernels on CUDA tensors (or any tensors under Triton's CPU interpreter, TRITON_INTERPRET=1
set before triton is imported); elsewhere, and for float64, they call the implementation their backend set falls
back to (so CPU engines work with every backend set).
"""

from __future__ import annotations

import torch

from .gpu import chunks_first, is_interpreted, pow2
from .pdl import pdl
from .routing import _permute_reference, _route_reference, _route_tiles

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs: reference and invariant only
    triton = None

_SCORE_CODE = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}     # the Triton kernel's SCORE constexpr

ROUTE_BLOCK_ROWS = 16      # rows per route program (tl.dot needs >= 16)
# expert columns per _route_logits_kernel program at decode: one program per (row block, chunk, column block), so
# a one-row route spreads over chunks x E / ROUTE_E_BLOCK programs (the same per-column arithmetic as one walk)
ROUTE_E_BLOCK = 64
# the logits' dots: "tf32x3" (three TF32 tensor-core products per term) or "ieee" (fp32 FMA units). H200
# (docs/results.md): one decode row 16 / 24 us (V4 / V4.1) against 31 / 37 us, 256 rows 29 / 57 us against 91 / 220,
# the ids the reference's at every size measured, weights within 8.8e-7 of max
ROUTE_PRECISION = "tf32x3"
ROUTE_CHUNK = 512          # D columns per logits chunk: the fixed unit of route's fp32 sum (V4 8, V4.1 10 chunks)
# `triton` rows from which the logits run on cuBLAS (fp32, as the reference) instead of the chunk programs: at 8192
# rows 0.48 / 0.85 ms (V4 / V4.1) against 0.51 / 1.26 ms with TF32x3 chunks (H200; FMA-unit ieee chunks took
# 2.5 / 6.4 ms). `triton_invariant` never takes it.
ROUTE_GEMM_ROWS = 512
PERMUTE_BLOCK_ROWS = 128   # rows per permute program (128 * next_pow2(k) sort keys)
PERMUTE_MIN_ROWS = 16      # fewer rows than a block sort in a block of pow2(rows), at least this (decode: b1 sorts
                           # 128 keys, not 1024)


if triton is not None:

    @triton.jit
    def _chunk_logits(x_ptr, w_ptr, rows64, row_ok, cols, col_ok, k0, D: tl.constexpr, CHUNK_ITERS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, E_PAD: tl.constexpr, PREC: tl.constexpr):
        """x W^T over the D columns [k0, k0 + CHUNK_ITERS * BLOCK_D) of rows `rows64`: [BLOCK_N, E_PAD] fp32,
        fp32 operands and accumulation (PREC: IEEE FMA dots, or TF32x3 on tensor cores), from zero. E_PAD is the
        width of `cols` (all of E, or one column block of it)."""
        dk = tl.arange(0, BLOCK_D)
        acc = tl.zeros((BLOCK_N, E_PAD), dtype=tl.float32)
        for it in range(CHUNK_ITERS):
            d = k0 + it * BLOCK_D + dk
            d_ok = d < D
            xt = tl.load(x_ptr + rows64[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            wt = tl.load(w_ptr + cols[None, :].to(tl.int64) * D + d[:, None], mask=d_ok[:, None] & col_ok[None, :],
                         other=0.0)                                                       # W^T tile [BLOCK_D, E_PAD]
            acc = tl.dot(xt.to(tl.float32), wt.to(tl.float32), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _route_logits_kernel(x_ptr, w_ptr, part_ptr, N, D: tl.constexpr, E: tl.constexpr,
                             CHUNK_ITERS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                             E_PAD: tl.constexpr, E_BLOCK: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
        """Program (b, s, j): part [S, N, E_PAD] fp32 at [s, rows of block b, experts of column block j] =
        chunk s's x W^T there (_chunk_logits over E_BLOCK columns)."""
        await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.program_id(1)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        cols = tl.program_id(2) * E_BLOCK + tl.arange(0, E_BLOCK)
        acc = _chunk_logits(x_ptr, w_ptr, rows64, row_ok, cols, cols < E, s * (CHUNK_ITERS * BLOCK_D), D,
                            CHUNK_ITERS, BLOCK_N, BLOCK_D, E_BLOCK, PREC)
        tl.store(part_ptr + (s.to(tl.int64) * N + rows64[:, None]) * E_PAD + cols[None, :], acc,
                 mask=row_ok[:, None])

    @triton.jit
    def _route_kernel(x_ptr, w_ptr, part_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, out_w_ptr, out_ids_ptr,
                      N, temp, route_scale, D: tl.constexpr, E: tl.constexpr,
                      K: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
                      NORMALIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      E_PAD: tl.constexpr, K_PAD: tl.constexpr, CHUNKS: tl.constexpr, CHUNK_ITERS: tl.constexpr,
                      FROM_PARTS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
        """One program: rows [pid * BLOCK_N, +BLOCK_N) of x [N, D] -> out_w [N, K] fp32, out_ids [N, K] int64.
        The logits are the sum, in chunk order, of CHUNKS chunk products (_chunk_logits): read from part
        (FROM_PARTS: _route_logits_kernel wrote them, one program per chunk) or computed here one after the
        other. Both orders of work do the same arithmetic per column; on the H200 with TF32x3 dots their last bits
        differ (the tiles differ), so only the `triton` set chooses by N (the invariant set always splits)."""
        await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, E_PAD)
        col_ok = cols < E

        acc = tl.zeros((BLOCK_N, E_PAD), dtype=tl.float32)                 # logits [BLOCK_N, E_PAD]
        for c in range(CHUNKS):
            if FROM_PARTS:
                chunk = tl.load(part_ptr + (c * N + rows64[:, None]) * E_PAD + cols[None, :],
                                mask=row_ok[:, None], other=0.0)
            else:
                chunk = _chunk_logits(x_ptr, w_ptr, rows64, row_ok, cols, col_ok, c * (CHUNK_ITERS * BLOCK_D), D,
                                      CHUNK_ITERS, BLOCK_N, BLOCK_D, E_PAD, PREC)
            acc = acc + chunk
        z = acc / temp

        if SCORE == 0:      # sqrt(softplus(z)), softplus as torch: z above 20, else log1p(exp(z))
            t = tl.exp(tl.minimum(z, 20.0))
            u = 1.0 + t
            log1p = tl.where(u == 1.0, t, tl.log(u) * (t / (u - 1.0)))     # accurate log1p(t) for small t
            scores = tl.sqrt(tl.where(z > 20.0, z, log1p))
        elif SCORE == 1:    # sigmoid
            scores = 1.0 / (1.0 + tl.exp(-z))
        else:               # softmax over the E real columns
            z = tl.where(col_ok[None, :], z, float("-inf"))
            ez = tl.exp(z - tl.max(z, axis=1)[:, None])
            scores = ez / tl.sum(ez, axis=1)[:, None]

        kcols = tl.arange(0, K_PAD)
        out_w = tl.zeros((BLOCK_N, K_PAD), dtype=tl.float32)
        out_ids = tl.zeros((BLOCK_N, K_PAD), dtype=tl.int64)
        if HASH:
            tok = tl.load(input_ids_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
            for j in tl.static_range(K):
                idx = tl.load(tid2eid_ptr + tok * K + j, mask=row_ok, other=0).to(tl.int64)
                w = tl.sum(tl.where(cols[None, :] == idx[:, None], scores, 0.0), axis=1)
                out_w = tl.where(kcols[None, :] == j, w[:, None], out_w)
                out_ids = tl.where(kcols[None, :] == j, idx[:, None], out_ids)
        else:
            sel = scores
            if HAS_BIAS:
                sel = sel + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            sel = tl.where(col_ok[None, :], sel, float("-inf"))
            for j in tl.static_range(K):           # k rounds of argmax; ties: the lowest expert id
                best = tl.max(sel, axis=1)
                idx = tl.min(tl.where(sel == best[:, None], cols[None, :], E_PAD), axis=1)
                idx = tl.minimum(idx, E - 1)       # NaN rows match nothing: keep the id in range
                hit = cols[None, :] == idx[:, None]
                w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
                out_w = tl.where(kcols[None, :] == j, w[:, None], out_w)
                out_ids = tl.where(kcols[None, :] == j, idx.to(tl.int64)[:, None], out_ids)
                sel = tl.where(hit, float("-inf"), sel)
        if NORMALIZE:
            out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
        out_w = out_w * route_scale
        at = rows64[:, None] * K + kcols[None, :]
        ok = row_ok[:, None] & (kcols[None, :] < K)
        tl.store(out_w_ptr + at, out_w, mask=ok)
        tl.store(out_ids_ptr + at, out_ids, mask=ok)

    @triton.jit
    def _expert_histogram_kernel(ids_ptr, l2p_ptr, counts_ptr, N, E,
                                 K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                                 K_PAD: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr):
        """counts [blocks, E] int32: how many (row, slot) pairs of block pid go to each physical expert.

        The histogram takes no mask: padding lanes (rows past N, slots past K) count into bin E, which the store
        drops (BINS = next_pow2(E + 1), at least 32). A masked tl.histogram miscounts on the GPU: Triton marks the reshapes
        feeding a histogram allow_reorder, the data's and the mask's each on its own, and when the two come from
        different layouts (here the load's vectorized one and the mask's) the mask lands on other elements. On
        the H200, n=1 k=6 E=256 counted 3 padding zeros into bin 0 and dropped 3 real pairs; the interpreter
        never reorders."""
        await_inputs(PDL)
        b = tl.program_id(0)
        rows = (b * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        slots = tl.arange(0, K_PAD)
        ok = (rows[:, None] < N) & (slots[None, :] < K)
        phys = tl.load(ids_ptr + rows[:, None] * K + slots[None, :], mask=ok, other=0)
        if HAS_MAP:
            phys = tl.load(l2p_ptr + phys, mask=ok, other=0)
        phys = tl.where(ok, phys.to(tl.int32), E)                   # padding: the sentinel bin E
        hist = tl.histogram(tl.reshape(phys, [BLOCK_ROWS * K_PAD]), BINS)
        e = tl.arange(0, BINS)
        tl.store(counts_ptr + b * E + e, hist, mask=e < E)

    @triton.jit
    def _permute_scatter_kernel(ids_ptr, w_ptr, l2p_ptr, delta_ptr, expert_ids_ptr, order_ptr, inverse_ptr,
                                sorted_w_ptr, rows_ptr, offsets_ptr, N, E,
                                K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                                K_PAD: tl.constexpr, SINGLE: tl.constexpr, BINS: tl.constexpr, PDL: tl.constexpr):
        """Block pid's pairs to their sorted positions: pos = delta[pid, expert] + rank of the pair within its
        block in (expert, row, slot rank) order, where delta = the expert's offset + its pairs in earlier
        blocks - its first position within this block's sorted keys. SINGLE (every row in this one block, as at
        decode): delta is 0, and the block writes offsets [E+1] itself from its histogram (no mask: padding
        lanes count into the sentinel bin E), so the whole permute is this one launch."""
        await_inputs(PDL)
        b = tl.program_id(0)
        lrow = tl.arange(0, BLOCK_ROWS)
        rows = (b * BLOCK_ROWS + lrow).to(tl.int64)
        slots = tl.arange(0, K_PAD)
        ok = (rows[:, None] < N) & (slots[None, :] < K)
        ids = tl.load(ids_ptr + rows[:, None] * K + slots[None, :], mask=ok, other=0).to(tl.int32)
        # stable rank of slot s within its row by logical id: the slots i with id_i < id_s, or id_i == id_s and i < s
        rank = tl.zeros((BLOCK_ROWS, K_PAD), dtype=tl.int32)
        for i in tl.static_range(K):
            id_i = tl.sum(tl.where(slots[None, :] == i, ids, 0), axis=1)[:, None]        # column i, [R, 1]
            rank += ((id_i < ids) | ((id_i == ids) & (i < slots[None, :]))).to(tl.int32)
        phys = ids
        if HAS_MAP:
            phys = tl.load(l2p_ptr + ids, mask=ok, other=0).to(tl.int32)
        if SINGLE:
            hist = tl.histogram(tl.reshape(tl.where(ok, phys, E), [BLOCK_ROWS * K_PAD]), BINS)
            e = tl.arange(0, BINS)
            tl.store(offsets_ptr + 1 + e, tl.cumsum(hist, 0).to(tl.int64), mask=e < E)
            tl.store(offsets_ptr + e, tl.zeros((BINS,), dtype=tl.int64), mask=e == 0)
        # one unique int32 key per pair, ordered as the reference's stable sorts order them: (expert, row,
        # rank); the original slot rides in the low bits. Padding sorts last.
        key = ((phys * BLOCK_ROWS + lrow[:, None]) * K_PAD + rank) * K_PAD + slots[None, :]
        key = tl.where(ok, key, 0x7FFFFFFF)
        key = tl.sort(tl.reshape(key, [BLOCK_ROWS * K_PAD]))
        j = tl.arange(0, BLOCK_ROWS * K_PAD)
        valid = key != 0x7FFFFFFF
        slot = key % K_PAD
        rest = key // K_PAD
        rk = rest % K_PAD
        rest = rest // K_PAD
        row = (b * BLOCK_ROWS + rest % BLOCK_ROWS).to(tl.int64)
        expert = rest // BLOCK_ROWS
        flat = row * K + rk
        if SINGLE:
            pos = j.to(tl.int64)
        else:
            pos = tl.load(delta_ptr + b * E + expert, mask=valid, other=0) + j
        w = tl.load(w_ptr + row * K + slot, mask=valid)
        tl.store(expert_ids_ptr + pos, expert.to(tl.int64), mask=valid)
        tl.store(order_ptr + pos, flat, mask=valid)
        tl.store(inverse_ptr + flat, pos, mask=valid)
        tl.store(sorted_w_ptr + pos, w, mask=valid)
        tl.store(rows_ptr + pos, row, mask=valid)

    # whether triton.jit made interpreted kernels (TRITON_INTERPRET=1 when this module was imported): they run on
    # CPU tensors (float32 / float16 / integers: the interpreter reads bfloat16 wrong, numpy having none)
    _INTERPRETED = is_interpreted(_route_kernel)

    def _runs_kernels(*tensors) -> bool:
        """Whether the kernels take these tensors: CUDA ones (any under the interpreter), none float64."""
        return all(t.dtype != torch.float64 for t in tensors) and (_INTERPRETED or all(t.is_cuda for t in tensors))

    def _route_triton(x, weight, bias, *, top_k, score_func, route_scale, temp, normalize, tid2eid=None,
                      input_ids=None, fallback=_route_reference, split=None, gemm_rows=None, fit_rows=False):
        """gemm_rows: from this many rows the logits run on cuBLAS (the reference's fp32 linear) into one part
        for the kernel's scores / top-k epilogue (None: never; the invariant set, since cuBLAS's reduction order
        may change with N). fit_rows: an epilogue over parts of fewer than ROUTE_BLOCK_ROWS rows (decode) runs
        in a block of pow2(N) rows on as few warps as its [rows, E] tile fills, not 16 rows on 8 warps (the
        epilogue needs no dot; its sums over experts may then round differently with N, so only `triton`)."""
        if not _runs_kernels(x, weight):
            return fallback(x, weight, bias, top_k=top_k, score_func=score_func, route_scale=route_scale,
                            temp=temp, normalize=normalize, tid2eid=tid2eid, input_ids=input_ids)
        n, d = x.shape
        e = weight.shape[0]
        out_w = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
        out_ids = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
        if n == 0:
            return out_w, out_ids
        hashed = tid2eid is not None
        e_pad = pow2(e, 16)
        block_d = min(64 if e_pad <= 256 else 32, pow2(d, 16))
        chunk_iters = max(2, ROUTE_CHUNK // block_d)     # >= 2: a one-step chunk could fold into the sum's add
        chunks = triton.cdiv(d, chunk_iters * block_d)
        x, weight = x.contiguous(), weight.contiguous()
        blocks = triton.cdiv(n, ROUTE_BLOCK_ROWS)
        warps = 8 if e_pad >= 256 else 4
        split = chunks_first(blocks, chunks, x.device) if split is None else split
        part = x
        if gemm_rows is not None and n >= gemm_rows:
            part = torch.zeros((1, n, e_pad), dtype=torch.float32, device=x.device)
            part[0, :, :e] = x.to(torch.float32) @ weight.to(torch.float32).t()
            chunks = 1
        elif split and chunks > 1:
            part = torch.empty((chunks, n, e_pad), dtype=torch.float32, device=x.device)
            e_block = min(ROUTE_E_BLOCK, e_pad)
            _route_logits_kernel[(blocks, chunks, e_pad // e_block)](
                x, weight, part, n, D=d, E=e, CHUNK_ITERS=chunk_iters, BLOCK_N=ROUTE_BLOCK_ROWS, BLOCK_D=block_d,
                E_PAD=e_pad, E_BLOCK=e_block, PREC=ROUTE_PRECISION, num_warps=4, **pdl(x.device))
        block_n = ROUTE_BLOCK_ROWS
        if fit_rows and part is not x and n < ROUTE_BLOCK_ROWS:
            block_n = pow2(n, 1)
            warps = max(1, min(warps, block_n * e_pad // 512))      # a warp per 512 logits (16 a lane)
            blocks = 1
        _route_kernel[(blocks,)](
            x, weight, part, x if bias is None or hashed else bias.contiguous(),
            tid2eid.contiguous() if hashed else x, input_ids.contiguous() if hashed else x, out_w, out_ids,
            n, float(temp), float(route_scale), D=d, E=e,
            K=top_k, SCORE=_SCORE_CODE[score_func], HAS_BIAS=bias is not None and not hashed, HASH=hashed,
            NORMALIZE=bool(normalize), BLOCK_N=block_n, BLOCK_D=block_d, E_PAD=e_pad,
            K_PAD=pow2(top_k, 1), CHUNKS=chunks, CHUNK_ITERS=chunk_iters, FROM_PARTS=part is not x,
            PREC=ROUTE_PRECISION, num_warps=warps, **pdl(x.device))
        return out_w, out_ids

    def _route_triton_default(x, weight, bias, **kw):
        # fit_rows (the few-row epilogue) is off here until its GPU tests have run (docs/kernels.md)
        return _route_triton(x, weight, bias, fallback=_route_reference, gemm_rows=ROUTE_GEMM_ROWS, **kw)

    def _route_triton_invariant(x, weight, bias, **kw):
        # always the chunk programs: with TF32x3 dots the walking programs' logits differ from theirs in last bits
        # (H200), so choosing by N would tie a row's bits to its batch; off the kernels, the tiled reference
        return _route_triton(x, weight, bias, fallback=_route_tiles, split=True, **kw)

    def _permute_triton(ids, weights, n_experts, logical_to_physical=None):
        maps = () if logical_to_physical is None else (logical_to_physical,)
        if not _runs_kernels(ids, weights, *maps):
            return _permute_reference(ids, weights, n_experts, logical_to_physical)
        n, k = ids.shape
        m, dev = n * k, ids.device
        k_pad = pow2(k, 1)
        rows = PERMUTE_BLOCK_ROWS if n > PERMUTE_BLOCK_ROWS else min(PERMUTE_BLOCK_ROWS, pow2(n, PERMUTE_MIN_ROWS))
        assert n_experts * rows * k_pad * k_pad < 2**31 - 1, "permute's int32 sort keys would overflow"
        outs = (torch.empty(m, dtype=torch.int64, device=dev), torch.empty(m, dtype=torch.int64, device=dev),
                torch.empty(m, dtype=torch.int64, device=dev), torch.empty(m, dtype=weights.dtype, device=dev),
                torch.empty(m, dtype=torch.int64, device=dev))        # expert_ids, order, inverse, weights, rows
        blocks = triton.cdiv(n, rows)
        bins = pow2(n_experts + 1, 32)
        if m == 0:
            return outs[0], torch.zeros(n_experts + 1, dtype=torch.int64, device=dev), *outs[1:]
        ids, weights = ids.contiguous(), weights.contiguous()
        l2p = ids if logical_to_physical is None else logical_to_physical.contiguous()
        common = dict(K=k, HAS_MAP=logical_to_physical is not None, BLOCK_ROWS=rows, K_PAD=k_pad, BINS=bins)
        if blocks == 1:                                   # decode: one launch (the kernel writes the offsets)
            offsets = torch.empty(n_experts + 1, dtype=torch.int64, device=dev)
            _permute_scatter_kernel[(1,)](ids, weights, l2p, ids, *outs, offsets, n, n_experts, **common, SINGLE=True,
                                          **pdl(ids.device))
            return outs[0], offsets, *outs[1:]
        offsets = torch.zeros(n_experts + 1, dtype=torch.int64, device=dev)
        counts = torch.empty(blocks, n_experts, dtype=torch.int32, device=dev)
        _expert_histogram_kernel[(blocks,)](ids, l2p, counts, n, n_experts, **common, **pdl(ids.device))
        counts = counts.long()
        offsets[1:] = counts.sum(0).cumsum(0)
        earlier_blocks = counts.cumsum(0) - counts          # [blocks, E]: the expert's pairs in blocks before
        in_block_start = counts.cumsum(1) - counts          # its first position among this block's sorted keys
        delta = (offsets[:-1] + earlier_blocks - in_block_start).contiguous()
        _permute_scatter_kernel[(blocks,)](ids, weights, l2p, delta, *outs, offsets, n, n_experts, **common,
                                           SINGLE=False, **pdl(ids.device))
        return outs[0], offsets, *outs[1:]
