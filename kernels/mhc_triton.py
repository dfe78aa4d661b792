"""Triton fused `hc_mixes` (issue 15, plan step 8): the mHC mixing weights of BLOCK_R rows in one launch instead of
about 45 torch kernels per site (RMS, the projection, three sigmoid / softmax pieces, 2 * iters Sinkhorn
normalizations).

Contract (kernels/mhc.py): streams [N, hc, D] -> (pre [N, hc], post [N, hc], comb [N, hc, hc]) in fp32, with
fn [(2 + hc) * hc, hc * D], base [(2 + hc) * hc], scale [3] fp32:
    m    = RMSnorm(flatten(streams)) @ fn^T                      (the norm's 1/rms applied after the dot: a row scalar)
    pre  = sigmoid(m[:hc] * scale0 + base[:hc]) + hc_eps
    post = 2 * sigmoid(m[hc:2hc] * scale1 + base[hc:2hc])
    comb = Sinkhorn(softmax(m[2hc:] as [hc, hc] * scale2 + base[2hc:]) + hc_eps): columns once, then rows and
           columns sinkhorn_iters - 1 times, each sum + hc_eps
Program r: rows [r*BLOCK_R, +BLOCK_R), K = hc*D streamed BLOCK_K at a time into three fp32 accumulators (pre,
post, comb columns of fn, padded to BLOCK_C) and the sum of squares; the epilogue runs in registers. fp32 dots at
ieee precision (the reference's F.linear in fp32). Rows are independent: batch-invariant as it is.

Numerics: the reference normalizes before the projection, the kernel after (one rounding apart), and sums K in
another order: interpreter <= 1e-6 of max for pre / post / comb (tests/interpreted/test_mhc_triton.py).

GPU status: interpreter and sm_90 compile only; outside the Triton sets (IN_TRITON_SETS) until `pytest -m gpu
tests/test_kernels_mhc_triton.py` passes.
"""

from __future__ import annotations

import torch

from .registry import implements, is_interpreted, on_kernel_device, pow2

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

IN_TRITON_SETS = False
BLOCK_R, WARPS = 16, 4
# sm_90 (ptxas on CPU): 16-bit streams at 128 no spills; fp32 at 128 spills 300 bytes, at 64 4 bytes
BLOCK_K = {torch.bfloat16: 128, torch.float16: 128, torch.float32: 64}


def supported(streams: torch.Tensor, fn: torch.Tensor) -> bool:
    """hc a power of two up to 8 (the [hc, hc] Sinkhorn tile is a register reshape), fp32 weights, and (outside
    the interpreter) CUDA tensors."""
    if triton is None or streams.dim() != 3 or streams.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    hc = streams.shape[1]
    if hc & (hc - 1) or hc * hc > 64 or fn.shape != ((2 + hc) * hc, hc * streams.shape[2]) or fn.dtype != torch.float32:
        return False
    return on_kernel_device(INTERPRETED, streams, fn)


if triton is not None:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _hc_mixes_kernel(x_ptr, fn_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, N, K, stride_x,
                         hc_eps, norm_eps,
                         HC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                         KITERS: tl.constexpr, ITERS: tl.constexpr):
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
        for it in range(KITERS):
            k = it * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(x_ptr + rows64[:, None] * stride_x + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)                           # [BLOCK_R, BLOCK_K]
            sq += tl.sum(x * x, axis=1)
            w_pre = tl.load(fn_ptr + c[None, :].to(tl.int64) * K + k[:, None], mask=k_ok[:, None] & one_ok[None, :],
                            other=0.0)                                      # [BLOCK_K, BLOCK_C]
            w_post = tl.load(fn_ptr + (HC + c[None, :]).to(tl.int64) * K + k[:, None],
                             mask=k_ok[:, None] & one_ok[None, :], other=0.0)
            w_comb = tl.load(fn_ptr + (2 * HC + c[None, :]).to(tl.int64) * K + k[:, None],
                             mask=k_ok[:, None] & sq_ok[None, :], other=0.0)
            acc_pre += tl.dot(x, w_pre, input_precision="ieee")
            acc_post += tl.dot(x, w_post, input_precision="ieee")
            acc_comb += tl.dot(x, w_comb, input_precision="ieee")
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


def hc_mixes_kernel(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    """The kernel on `supported` inputs (callers check)."""
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
    _hc_mixes_kernel[(triton.cdiv(n, BLOCK_R),)](
        x, fn.contiguous(), base.to(torch.float32).contiguous(), scale.to(torch.float32).contiguous(), pre, post,
        comb, n, k, x.stride(0), float(hc_eps), float(norm_eps), HC=hc, BLOCK_C=block_c, BLOCK_R=BLOCK_R,
        BLOCK_K=block_k, KITERS=triton.cdiv(k, block_k), ITERS=max(int(sinkhorn_iters), 1), num_warps=WARPS)
    return pre, post, comb


def hc_mixes_triton(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    if not supported(streams, fn) or sinkhorn_iters < 1:
        from .mhc import _hc_mixes
        return _hc_mixes(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return hc_mixes_kernel(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)


def hc_mixes_triton_invariant(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    if not supported(streams, fn) or sinkhorn_iters < 1:
        from .mhc import _hc_mixes_tiles
        return _hc_mixes_tiles(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)
    return hc_mixes_kernel(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)   # rows independent


if triton is not None and IN_TRITON_SETS:
    implements("hc_mixes", "triton")(hc_mixes_triton)
    implements("hc_mixes", "triton_invariant")(hc_mixes_triton_invariant)
