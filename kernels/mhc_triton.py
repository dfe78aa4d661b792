"""Triton mHC ops (the contracts: kernels/mhc.py): `hc_mixes` fused, and the per-row stream sums `hc_collapse` and
`hc_post`, for `triton` and `triton_invariant` (`hc_head` runs its fallback).

hc_mixes: the mHC mixing weights of BLOCK_R rows in one launch instead of about 45 torch kernels per site (RMS, the
projection, three sigmoid / softmax pieces, 2 * iters Sinkhorn normalizations).

Contract (kernels/mhc.py): streams [N, hc, D] -> (pre [N, hc], post [N, hc], comb [N, hc, hc]) in fp32, with
fn [(2 + hc) * hc, hc * D], base [(2 + hc) * hc], scale [3] fp32:
    m    = RMSnorm(flatten(streams)) @ fn^T                      (the norm's 1/rms applied after the dot: a row scalar)
    pre  = sigmoid(m[:hc] * scale0 + base[:hc]) + hc_eps
    post = 2 * sigmoid(m[hc:2hc] * scale1 + base[hc:2hc])
    comb = Sinkhorn(softmax(m[2hc:] as [hc, hc] * scale2 + base[2hc:]) + hc_eps): columns once, then rows and
           columns sinkhorn_iters - 1 times, each sum + hc_eps
Program r: rows [r*BLOCK_R, +BLOCK_R), K = hc*D summed over fixed CHUNK-column chunks, each streamed BLOCK_K at a
time into three fp32 accumulators (pre, post, comb columns of fn, padded to BLOCK_C) and the sum of squares, the
chunks added in order; the epilogue runs in registers. At decode (few row blocks) a first kernel computes the
chunks, one program per (row block, chunk, group of pre / post / comb columns), and the mixes kernel adds them:
one program walking all of K (1.5 MB of fn at V4) took 870 us a call on an H200, one per (row block, chunk) 56 us,
one per group too 32 us, with TF32x3 dots 20 us (docs/results.md). The dots are TF32x3 (PRECISION; three
tensor-core products per term, about 2^-21 relative each; "ieee" runs them on FMA units). The two orders of work
agree bitwise in the interpreter but not on the H200 (last bits, within the reference bound), so `triton` picks
by N and `triton_invariant` always takes the chunk kernel: its rows are then independent of the batch (partial
sums in memory: 5 KB a row at V4.1, 84 MB for 16k rows). ptxas (sm_90, Triton 3.6) with TF32x3: the chunk kernel
spills 12 bytes (bf16 streams), the walking mixes kernel 644, a path no batch takes on an H200
(tests/test_kernels_compile_sm90.py).

Numerics: the reference normalizes before the projection, the kernel after (one rounding apart), and sums K in
another order: interpreter <= 1e-6 of max for pre / post / comb (tests/interpreted/test_mhc_triton.py); H200, bf16
streams at the released widths, 1-8192 rows: 1.6e-7 to 2.1e-6 of max for comb (TF32x3 and ieee alike).

hc_collapse / hc_post: one launch each, where the invariant backend runs the torch reference once per 16-row tile
(at batch 256 these row-tiled pieces were among the step's hundreds of small kernels on the H200: docs/results.md).
Streams h [N, hc, D], math in fp32, outputs in h's dtype:
    hc_collapse(h, pre [N, hc])                 -> [N, D]:      sum_j pre[n, j] * h[n, j, :]
    hc_post(f [N, D], h, post [N, hc], comb [N, hc, hc]) -> [N, hc, D]:
                                                 post[n, k] * f[n, :] + sum_j comb[n, j, k] * h[n, j, :]
Program (n, d-block): row n's hc streams over ROWS_BLOCK_D columns, the j-sums in order j = 0..hc-1. Row-local with
a fixed order, so a row's bits never depend on its batch: one kernel serves both sets. Numerics: the reference sums
j with torch's reduction / a batched matmul, the kernel in order: interpreter (fp32) <= 1e-6 of max
(tests/interpreted/test_mhc_rows_triton.py).
"""

from __future__ import annotations

import torch

from .gpu import chunks_first, is_interpreted, on_kernel_device, pow2
from .mhc import _hc_collapse, _hc_collapse_tiles, _hc_mixes, _hc_mixes_tiles, _hc_post, _hc_post_tiles
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

BLOCK_R, WARPS = 16, 4
# `triton` rows from which the projection runs on cuBLAS (gemm_parts): measured faster than the chunk kernel from
# 256 rows on the H200 (docs/results.md). Decode batches below it keep the chunk kernel (a 512-row
# decode graph takes the GEMM: capturable, no host sync); `triton_invariant` never takes the GEMM (cuBLAS's
# reduction order may change with N).
GEMM_ROWS = 512
# the projection's dots: "tf32x3" (three TF32 tensor-core products per term, about 2^-21 relative per product) or
# "ieee" (fp32 FMA units). H200 (docs/results.md): one decode row 20 us against 32 us (V4 and V4.1),
# 256 rows 70 / 134 us, 8192 rows 1.7 / 3.8 ms; error against the reference 1.7e-7 to 2.1e-6 of max either way
PRECISION = "tf32x3"
CHUNK = 1024          # hc * d columns per chunk: the fixed unit of the projection's fp32 sum (V4 16, V4.1 20)
# sm_90 (ptxas on CPU): 16-bit streams at 128 no spills; fp32 at 128 spills 300 bytes, at 64 4 bytes
BLOCK_K = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 64}
ROWS_BLOCK_D, ROWS_WARPS = 1024, 4      # hc_collapse / hc_post: columns per program
MAX_HC = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supported(streams: torch.Tensor, fn: torch.Tensor) -> bool:
    """hc a power of two up to 8 (the [hc, hc] Sinkhorn tile is a register reshape), fp32 weights, and (outside
    the interpreter) CUDA tensors."""
    if triton is None or streams.dim() != 3 or streams.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    hc = streams.shape[1]
    if hc & (hc - 1) or hc * hc > 64 or fn.shape != ((2 + hc) * hc, hc * streams.shape[2]) or fn.dtype != torch.float32:
        return False
    return on_kernel_device(INTERPRETED, streams, fn)


def rows_supported(h: torch.Tensor, *others: torch.Tensor) -> bool:
    """h [N, hc, D] of a kernel dtype with hc <= MAX_HC, the others on its device."""
    if triton is None or h.dim() != 3 or h.dtype not in DTYPES or h.shape[1] > MAX_HC or h.numel() == 0:
        return False
    return on_kernel_device(INTERPRETED, h, *others)


if triton is not None:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _chunk_dot(x_ptr, fn_ptr, rows64, r_ok, col0, c, c_ok, k0, K, stride_x, BLOCK_R: tl.constexpr,
                   BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_ITERS: tl.constexpr, PREC: tl.constexpr):
        """Columns [k0, k0 + CHUNK_ITERS * BLOCK_K) of the rows times fn's rows col0 + c (c_ok of them):
        ([BLOCK_R, BLOCK_C] fp32 from zero, the rows' sum of squares [BLOCK_R])."""
        acc = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        sq = tl.zeros((BLOCK_R,), tl.float32)
        for it in range(CHUNK_ITERS):
            k = k0 + it * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + rows64[:, None] * stride_x + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)                           # [BLOCK_R, BLOCK_K]
            sq += tl.sum(x * x, axis=1)
            w = tl.load(fn_ptr + (col0 + c[None, :]).to(tl.int64) * K + k[:, None],
                        mask=k_ok[:, None] & c_ok[None, :], other=0.0)       # [BLOCK_K, BLOCK_C]
            acc = tl.dot(x, w, acc, input_precision=PREC)
        return acc, sq

    @triton.jit
    def _chunk_mixes(x_ptr, fn_ptr, rows64, r_ok, c, one_ok, sq_ok, k0, K, stride_x, HC: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_ITERS: tl.constexpr,
                     PREC: tl.constexpr):
        """The chunk's x.fn^T for pre, post, comb [BLOCK_R, BLOCK_C] and its sum of squares [BLOCK_R], fp32:
        three _chunk_dot groups (the same arithmetic as three programs of _hc_chunks_kernel)."""
        pre, sq = _chunk_dot(x_ptr, fn_ptr, rows64, r_ok, 0, c, one_ok, k0, K, stride_x, BLOCK_R, BLOCK_C,
                             BLOCK_K, CHUNK_ITERS, PREC)
        post, _ = _chunk_dot(x_ptr, fn_ptr, rows64, r_ok, HC, c, one_ok, k0, K, stride_x, BLOCK_R, BLOCK_C,
                             BLOCK_K, CHUNK_ITERS, PREC)
        comb, _ = _chunk_dot(x_ptr, fn_ptr, rows64, r_ok, 2 * HC, c, sq_ok, k0, K, stride_x, BLOCK_R, BLOCK_C,
                             BLOCK_K, CHUNK_ITERS, PREC)
        return pre, post, comb, sq

    @triton.jit
    def _hc_chunks_kernel(x_ptr, fn_ptr, part_ptr, N, K, stride_x, HC: tl.constexpr, BLOCK_C: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_ITERS: tl.constexpr,
                          PREC: tl.constexpr, PDL: tl.constexpr):
        """Program (b, s, g): part [S, N, 4, BLOCK_C] fp32 at [s, rows of block b, g] = chunk s's group g (pre,
        post, comb) product from _chunk_dot; group 0 also stores the sum of squares (slot 3, column 0)."""
        await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        s = tl.program_id(1)
        g = tl.program_id(2)
        r_ok = rows < N
        rows64 = rows.to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        width = tl.where(g == 2, HC * HC, HC)
        acc, sq = _chunk_dot(x_ptr, fn_ptr, rows64, r_ok, g * HC, c, c < width, s * (CHUNK_ITERS * BLOCK_K), K,
                             stride_x, BLOCK_R, BLOCK_C, BLOCK_K, CHUNK_ITERS, PREC)
        at = part_ptr + ((s.to(tl.int64) * N + rows64[:, None]) * 4 + g) * BLOCK_C + c[None, :]
        tl.store(at, acc, mask=r_ok[:, None])
        if g == 0:
            tl.store(part_ptr + ((s.to(tl.int64) * N + rows64) * 4 + 3) * BLOCK_C, sq, mask=r_ok)

    @triton.jit
    def _hc_mixes_kernel(x_ptr, fn_ptr, part_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, N, K, stride_x,
                         hc_eps, norm_eps,
                         HC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         CHUNKS: tl.constexpr, CHUNK_ITERS: tl.constexpr, FROM_PARTS: tl.constexpr,
                         ITERS: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr):
        """Rows [pid * BLOCK_R, +BLOCK_R): the mixes from the sum, in chunk order, of CHUNKS chunk products
        (_chunk_mixes): read from part (FROM_PARTS: _hc_chunks_kernel wrote them, a program per chunk) or
        computed here one after the other."""
        await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < N
        rows64 = rows.to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        one_ok = c < HC                                                  # pre / post columns
        sq_ok = c < HC * HC                                              # comb columns
        acc_pre = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        acc_post = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        acc_comb = tl.zeros((BLOCK_R, BLOCK_C), tl.float32)
        sq = tl.zeros((BLOCK_R,), tl.float32)
        for ch in range(CHUNKS):
            if FROM_PARTS:
                at = part_ptr + ((ch * N + rows64[:, None]) * 4) * BLOCK_C + c[None, :]
                p_pre = tl.load(at, mask=r_ok[:, None], other=0.0)
                p_post = tl.load(at + BLOCK_C, mask=r_ok[:, None], other=0.0)
                p_comb = tl.load(at + 2 * BLOCK_C, mask=r_ok[:, None], other=0.0)
                p_sq = tl.load(part_ptr + ((ch * N + rows64) * 4 + 3) * BLOCK_C, mask=r_ok, other=0.0)
            else:
                p_pre, p_post, p_comb, p_sq = _chunk_mixes(x_ptr, fn_ptr, rows64, r_ok, c, one_ok, sq_ok,
                                                           ch * (CHUNK_ITERS * BLOCK_K), K, stride_x, HC,
                                                           BLOCK_R, BLOCK_C, BLOCK_K, CHUNK_ITERS, PREC)
            acc_pre = acc_pre + p_pre
            acc_post = acc_post + p_post
            acc_comb = acc_comb + p_comb
            sq = sq + p_sq
        rs = 1.0 / tl.sqrt(sq / K + norm_eps)
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        b_pre = tl.load(base_ptr + c, mask=one_ok, other=0.0)
        b_post = tl.load(base_ptr + HC + c, mask=one_ok, other=0.0)
        b_comb = tl.load(base_ptr + 2 * HC + c, mask=sq_ok, other=0.0)
        pre = _sigmoid(acc_pre * rs[:, None] * s0 + b_pre[None, :]) + hc_eps
        post = 2.0 * _sigmoid(acc_post * rs[:, None] * s1 + b_post[None, :])
        out_one = rows64[:, None] * HC + c[None, :]
        tl.store(pre_ptr + out_one, pre, mask=r_ok[:, None] & one_ok[None, :])
        tl.store(post_ptr + out_one, post, mask=r_ok[:, None] & one_ok[None, :])
        logits = acc_comb * rs[:, None] * s2 + b_comb[None, :]               # [BLOCK_R, BLOCK_C]
        logits = tl.reshape(tl.where(sq_ok[None, :], logits, float("-inf")), (BLOCK_R, BLOCK_C // HC, HC))
        rowmax = tl.max(logits, axis=2)
        rowmax = tl.where(rowmax == float("-inf"), 0.0, rowmax)              # the padding rows of the [hc, hc] view
        e = tl.exp(logits - rowmax[:, :, None])                              # (hc < 4): all 0 there
        den = tl.sum(e, axis=2)
        comb = e / tl.where(den == 0.0, 1.0, den)[:, :, None]
        j = tl.arange(0, BLOCK_C // HC)
        live = (j < HC)[None, :, None]
        comb = tl.where(live, comb + hc_eps, 0.0)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)            # columns once
        for _ in range(ITERS - 1):                                          # then rows and columns
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = tl.where(live, comb, 0.0)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        flat = tl.reshape(comb, (BLOCK_R, BLOCK_C))
        tl.store(comb_ptr + rows64[:, None] * (HC * HC) + c[None, :], flat, mask=r_ok[:, None] & sq_ok[None, :])

    INTERPRETED = is_interpreted(_hc_mixes_kernel)
else:
    INTERPRETED = False


def gemm_parts(x: torch.Tensor, fn: torch.Tensor, hc: int, block_c: int) -> torch.Tensor:
    """The projection of many rows on cuBLAS (the reference's fp32 F.linear, without its normalization) and the
    rows' sums of squares, laid out as one chunk of _hc_chunks_kernel's parts: [1, N, 4, block_c] fp32."""
    xf = x.to(torch.float32)                                                  # [N, K]
    m = xf @ fn.t()                                                           # [N, (2 + hc) * hc]
    part = torch.zeros((1, x.shape[0], 4, block_c), dtype=torch.float32, device=x.device)
    part[0, :, 0, :hc] = m[:, :hc]
    part[0, :, 1, :hc] = m[:, hc:2 * hc]
    part[0, :, 2, :hc * hc] = m[:, 2 * hc:]
    part[0, :, 3, 0] = torch.linalg.vecdot(xf, xf)                              # no second [N, K] temporary
    return part


def hc_mixes_kernel(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, split: bool | None = None,
                    gemm: bool = False):
    """The kernels on `supported` inputs (callers check). split: one program per (row block, chunk, group) first,
    then the mixes (decode: the few row blocks alone would each walk all of K), or each row block walks its chunks
    (None: by the row blocks against the SMs). gemm: the projection on cuBLAS first (gemm_parts: prefill-sized
    batches; 8192 rows 1.06 / 1.31 ms at V4 / V4.1 against the TF32x3 chunks' 1.68 / 2.10 ms on the H200), then
    the mixes kernel's epilogue over that one part."""
    n, hc, d = streams.shape
    k = hc * d
    dev = streams.device
    pre = torch.empty((n, hc), dtype=torch.float32, device=dev)
    post = torch.empty((n, hc), dtype=torch.float32, device=dev)
    comb = torch.empty((n, hc, hc), dtype=torch.float32, device=dev)
    if n == 0:
        return pre, post, comb
    x = streams.reshape(n, k)
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_c = pow2(hc * hc)
    block_k = BLOCK_K[streams.dtype]
    chunk_iters = max(2, CHUNK // block_k)     # >= 2: a one-step chunk could fold into the sum's add
    chunks = triton.cdiv(k, chunk_iters * block_k)
    blocks = triton.cdiv(n, BLOCK_R)
    fn = fn.contiguous()
    split = chunks_first(blocks, chunks, dev) if split is None else split
    part = x
    if gemm:
        part, chunks = gemm_parts(x, fn, hc, block_c), 1
    elif split:
        part = torch.empty((chunks, n, 4, block_c), dtype=torch.float32, device=dev)
        _hc_chunks_kernel[(blocks, chunks, 3)](x, fn, part, n, k, x.stride(0), HC=hc, BLOCK_C=block_c,
                                               BLOCK_R=BLOCK_R, BLOCK_K=block_k, CHUNK_ITERS=chunk_iters,
                                               PREC=PRECISION, num_warps=WARPS, **pdl(x.device))
    _hc_mixes_kernel[(blocks,)](
        x, fn, part, base.to(torch.float32).contiguous(), scale.to(torch.float32).contiguous(), pre, post,
        comb, n, k, x.stride(0), float(hc_eps), float(norm_eps), HC=hc, BLOCK_C=block_c, BLOCK_R=BLOCK_R,
        BLOCK_K=block_k, CHUNKS=chunks, CHUNK_ITERS=chunk_iters, FROM_PARTS=part is not x,
        ITERS=max(int(sinkhorn_iters), 1), PREC=PRECISION, num_warps=WARPS, **pdl(x.device))
    return pre, post, comb


def hc_mixes_triton(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    if not supported(streams, fn) or sinkhorn_iters < 1:
        return _hc_mixes(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return hc_mixes_kernel(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters,
                           gemm=streams.shape[0] >= GEMM_ROWS)


def hc_mixes_triton_invariant(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    if not supported(streams, fn) or sinkhorn_iters < 1:
        return _hc_mixes_tiles(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return hc_mixes_kernel(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, split=True)  # any N: same bits

if triton is not None:

    @triton.jit
    def _collapse_kernel(h_ptr, pre_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = d < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in tl.static_range(HC):
            w = tl.load(pre_ptr + n * HC + j).to(tl.float32)
            acc += w * tl.load(h_ptr + (n * HC + j) * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _post_kernel(f_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = d < D
        f = tl.load(f_ptr + n * D + d, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(HC):
            mixed = tl.zeros((BLOCK_D,), dtype=tl.float32)
            for j in tl.static_range(HC):
                c = tl.load(comb_ptr + (n * HC + j) * HC + k).to(tl.float32)
                mixed += c * tl.load(h_ptr + (n * HC + j) * D + d, mask=mask, other=0.0).to(tl.float32)
            p = tl.load(post_ptr + n * HC + k).to(tl.float32)
            tl.store(out_ptr + (n * HC + k) * D + d, (p * f + mixed).to(out_ptr.dtype.element_ty), mask=mask)


def hc_collapse_kernel(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    n, hc, d = h.shape
    h, pre = h.contiguous(), pre.to(torch.float32).contiguous()
    out = torch.empty((n, d), dtype=h.dtype, device=h.device)
    _collapse_kernel[(n, triton.cdiv(d, ROWS_BLOCK_D))](h, pre, out, d, HC=hc, BLOCK_D=ROWS_BLOCK_D,
                                                        num_warps=ROWS_WARPS, **pdl(h.device))
    return out


def hc_post_kernel(f: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    n, hc, d = h.shape
    f, h = f.reshape(n, d).contiguous(), h.contiguous()
    post, comb = post.to(torch.float32).contiguous(), comb.to(torch.float32).contiguous()
    out = torch.empty_like(h)
    _post_kernel[(n, triton.cdiv(d, ROWS_BLOCK_D))](f, h, post, comb, out, d, HC=hc, BLOCK_D=ROWS_BLOCK_D,
                                                    num_warps=ROWS_WARPS, **pdl(f.device))
    return out


def hc_collapse_triton(h, pre):
    return hc_collapse_kernel(h, pre) if rows_supported(h, pre) else _hc_collapse(h, pre)


def hc_post_triton(f, h, post, comb):
    return hc_post_kernel(f, h, post, comb) if rows_supported(h, f, post, comb) else _hc_post(f, h, post, comb)


def hc_collapse_triton_invariant(h, pre):          # row-local: the same kernel; the fallback on row tiles
    return hc_collapse_kernel(h, pre) if rows_supported(h, pre) else _hc_collapse_tiles(h, pre)


def hc_post_triton_invariant(f, h, post, comb):
    return hc_post_kernel(f, h, post, comb) if rows_supported(h, f, post, comb) else _hc_post_tiles(f, h, post, comb)
