"""Triton backends of `fp8_linear` and `quantize_act_fp8` (the recipe: kernels/fp8_linear.py).

  triton            two paths chosen from M inside the op:
                      decode  (M <= DECODE_MAX_M): BLOCK_M 16, BLOCK_N 64, BLOCK_K 128, the activation quantized
                              inside the GEMM (no extra launch), split-K over the 128-blocks when the (M, N) tiles
                              alone leave SMs idle, partials [S, M, N] fp32 summed by a second pass in a fixed order.
                      prefill (M > DECODE_MAX_M): x quantized once (quantize_act_fp8's kernel), then BLOCK_M 64
                              (128 from M >= 512), BLOCK_N 128, BLOCK_K 128 = one scale block per K step: fp8
                              tl.dot, its fp32 partial times scale_x[:, b] * scale_w[b] added to an fp32
                              accumulator (the promotion at every 128 of K), num_stages 4 (3 for BLOCK_M 128),
                              grouped program order (GROUP_M 8) for L2 reuse of the weight tiles.
  triton_invariant  one fixed configuration whatever M (INVARIANT_CONFIG: BLOCK_M 64, BLOCK_N 64, no split-K).
Both run the reference (invariant: the torch invariant backend) on CPU tensors unless this module was imported with
TRITON_INTERPRET=1. The activation quantizer is exact arithmetic, so one kernel serves both sets.
"""

from __future__ import annotations

import torch

from .fp8_linear import BLOCK, BLOCKS, _act_quant_ref, _check, _fp8_linear_ref, _fp8_linear_tiles
from .gpu import is_interpreted, on_kernel_device, sm_count
from .pdl import pdl

try:                                    # optional: CPU-only installs have no triton
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:                     # pragma: no cover - exercised where triton is absent
    triton = None
else:
    from .quant_triton import quant_tile

DECODE_MAX_M = 64           # triton: rows up to this many take the decode path
DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4)
PREFILL_WIDE_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)   # M >= PREFILL_WIDE_M
PREFILL_WIDE_M = 512
INVARIANT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)
GROUP_M = 8                 # prefill: row tiles per group of the program order
ACT_QUANT_ROWS = 32         # act-quant kernel: rows per program
_INTERPRET = False          # set below: whether triton.jit made interpreted kernels (TRITON_INTERPRET=1 at import)
if triton is not None:

    @triton.jit
    def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, stride_s,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SOFT_CVT: tl.constexpr, PDL: tl.constexpr):
        """Program (i, b): rows [i*BLOCK_R, +BLOCK_R) of K-block b -> q [M, K] fp8, s [M, nb] fp32."""
        await_inputs(PDL)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rows64 = rows.to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        xf = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = quant_tile(xf, SOFT_CVT)
        tl.store(q_ptr + rows64[:, None] * stride_q + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows64 * stride_s + tl.program_id(1), scale, mask=rows < M)

    @triton.jit
    def _fp8_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, y_ptr, M, N, K, NKB, KB_PER_SPLIT: tl.constexpr,
                         stride_x, stride_sx, stride_w, stride_sw, stride_ys, stride_y,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP: tl.constexpr, FUSE_QUANT: tl.constexpr, SW_E8M0: tl.constexpr,
                         SOFT_CVT: tl.constexpr, PDL: tl.constexpr):
        """y [S, M, N] (S = splits; y_ptr offset by stride_ys per split) = this split's K-blocks of the recipe.

        Program (p, s): output tile p (grouped order) over K-blocks [s*KB_PER_SPLIT, +KB_PER_SPLIT). BLOCK_K is
        the scale block (128 or 32): one K step per block of scales.
        FUSE_QUANT: x_ptr holds the activations in their float dtype, quantized here per [BLOCK_M, BLOCK_K];
        else x_ptr holds x_fp8 and sx_ptr its scales [M, nb]. w [N, K] fp8, sw [ceil(N/BLOCK_K), nb] e8m0 /
        fp32: one scale per tile when BLOCK_N <= BLOCK_K (it divides it), one per column block otherwise."""
        await_inputs(PDL)
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP * num_n
        first_m = (pid // per_group) * GROUP
        group_m = tl.minimum(num_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
        row_ok, col_ok = rows < M, cols < N
        SW_VEC: tl.constexpr = BLOCK_N > BLOCK_K
        if SW_VEC:
            sw_rows = sw_ptr + (cols // BLOCK_K).to(tl.int64) * stride_sw   # [BLOCK_N]: the column's scale row
        else:
            sw_rows = sw_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_sw   # BLOCK_N divides BLOCK_K
        kb0 = tl.program_id(1) * KB_PER_SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(0, KB_PER_SPLIT):               # the last split may run past NKB: masked, adds zeros
            kb = kb0 + i
            kb_ok = kb < NKB
            kbc = tl.minimum(kb, NKB - 1)          # a valid block to read; its scale is zeroed when past NKB
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            xt = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                         other=0.0)
            if FUSE_QUANT:
                xq, sx = quant_tile(xt.to(tl.float32), SOFT_CVT)
            else:
                xq = xt
                sx = tl.where(kb_ok, tl.load(sx_ptr + rows64 * stride_sx + kbc, mask=row_ok, other=0.0), 0.0)
            wt = tl.load(w_ptr + cols64[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None],
                         other=0.0)                                          # [BLOCK_K, BLOCK_N], K-major
            if SW_VEC:
                raw = tl.load(sw_rows + kbc, mask=col_ok, other=0)
            else:
                raw = tl.load(sw_rows + kbc)
            if SW_E8M0:
                b = tl.where(kb_ok, raw.to(tl.int32), 0)
                sbits = tl.where(b == 0, 0x400000, tl.where(b == 255, 0x7FC00000, b << 23))
                sw = sbits.to(tl.float32, bitcast=True)
            else:
                sw = tl.where(kb_ok, raw, 0.0)
            part = tl.dot(xq, wt)                                            # fp32 [BLOCK_M, BLOCK_N]
            if SW_VEC:
                acc += part * (sx[:, None] * sw[None, :])
            else:
                acc += part * (sx[:, None] * sw)
        out = y_ptr + tl.program_id(1).to(tl.int64) * stride_ys + rows64[:, None] * stride_y + cols[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    _INTERPRET = is_interpreted(_fp8_gemm_kernel)

    def _sm_count(device: torch.device) -> int:
        """SMs of a CUDA device (16 under the interpreter, so small test shapes still split K)."""
        return sm_count(device) or 16

    def _act_quant_triton_2d(x2: torch.Tensor, block: int):
        M, K = x2.shape
        nb = -(-K // block)
        q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x2.device)
        s = torch.empty((M, nb), dtype=torch.float32, device=x2.device)
        if M and nb:
            grid = (triton.cdiv(M, ACT_QUANT_ROWS), nb)
            _act_quant_kernel[grid](x2, q, s, M, K, x2.stride(0), q.stride(0), s.stride(0),
                                    BLOCK_R=ACT_QUANT_ROWS, BLOCK_K=block, SOFT_CVT=_INTERPRET, num_warps=4,
                                    **pdl(x2.device))
        return q, s

    def _act_quant_triton(x, block=BLOCK):
        if (not on_kernel_device(_INTERPRET, x) or block & (block - 1)
                or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
            return _act_quant_ref(x, block)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[-1] and x2.stride(-1) != 1:
            x2 = x2.contiguous()
        q, s = _act_quant_triton_2d(x2, block)
        return q.view(x.shape), s.view(*x.shape[:-1], s.shape[-1])

    def _pick_config(M: int, invariant: bool) -> tuple[dict, bool]:
        """(tile config, fuse the activation quant); the decode path splits K on top of it."""
        if invariant:
            return INVARIANT_CONFIG, False
        if M <= DECODE_MAX_M:
            return DECODE_CONFIG, True
        return (PREFILL_WIDE_CONFIG if M >= PREFILL_WIDE_M else PREFILL_CONFIG), False

    def _split_k(M: int, N: int, nkb: int, cfg: dict, device: torch.device) -> int:
        """K-blocks per split for the decode path: enough splits that the (M, N) tiles cover every SM."""
        tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
        splits = max(1, min(nkb, _sm_count(device) // tiles))
        return triton.cdiv(nkb, splits)

    def _fp8_linear_2d(x2, w_fp8, w_scale, out_dtype, cfg: dict, fuse: bool, kb_per_split: int | None,
                       block: int = BLOCK):
        """x2 [M, K] -> [M, N] with one tile config; kb_per_split None: no split."""
        M, K = x2.shape
        N = w_fp8.shape[0]
        nkb = triton.cdiv(K, block)
        kb_per_split = kb_per_split or nkb
        splits = triton.cdiv(nkb, kb_per_split)
        if fuse:
            xk, sx = x2, x2                                      # sx unused
        else:
            xk, sx = _act_quant_triton_2d(x2, block)
        e8m0 = w_scale.dtype in (torch.uint8, torch.float8_e8m0fnu)
        sw = w_scale.view(torch.uint8) if e8m0 else w_scale.to(torch.float32)
        if w_fp8.stride(-1) != 1:
            w_fp8 = w_fp8.contiguous()
        if sw.stride(-1) != 1:
            sw = sw.contiguous()
        y = torch.empty((splits, M, N), dtype=out_dtype if splits == 1 else torch.float32, device=x2.device)
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), splits)
        _fp8_gemm_kernel[grid](
            xk, sx, w_fp8, sw, y, M, N, K, nkb, kb_per_split,
            xk.stride(0), sx.stride(0), w_fp8.stride(0), sw.stride(0), y.stride(0), y.stride(1),
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block, GROUP=1 if fuse else GROUP_M,
            FUSE_QUANT=fuse, SW_E8M0=e8m0, SOFT_CVT=_INTERPRET,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl(xk.device))
        return y[0] if splits == 1 else y.sum(0).to(out_dtype)       # second pass: splits summed in order

    def _fp8_linear_triton_any(x, w_fp8, w_scale, out_dtype, invariant: bool, path: str | None = None,
                               block: int = BLOCK):
        """path (tests): "decode" | "prefill" | "invariant" forces a configuration; None picks it from M."""
        _check(x, w_fp8, w_scale, block)
        out_dtype = out_dtype or x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        M, (N, K) = x2.shape[0], w_fp8.shape
        if M == 0 or K == 0:
            return torch.zeros((*x.shape[:-1], N), dtype=out_dtype, device=x.device)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        if path is None:
            cfg, fuse = _pick_config(M, invariant)
        else:
            cfg, fuse = {"decode": (DECODE_CONFIG, True), "prefill": (PREFILL_CONFIG, False),
                         "prefill_wide": (PREFILL_WIDE_CONFIG, False), "invariant": (INVARIANT_CONFIG, False)}[path]
        kb_per_split = _split_k(M, N, triton.cdiv(K, block), cfg, x.device) if fuse else None
        y = _fp8_linear_2d(x2, w_fp8, w_scale, out_dtype, cfg, fuse, kb_per_split, block)
        return y.view(*x.shape[:-1], N)

    def _supported(x, w_fp8, w_scale, block) -> bool:
        return (on_kernel_device(_INTERPRET, x, w_fp8, w_scale) and w_fp8.dtype == torch.float8_e4m3fn
                and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and block in BLOCKS)

    def _fp8_linear_triton(x, w_fp8, w_scale, out_dtype=None, block=BLOCK):
        if not _supported(x, w_fp8, w_scale, block):
            return _fp8_linear_ref(x, w_fp8, w_scale, out_dtype, block)
        return _fp8_linear_triton_any(x, w_fp8, w_scale, out_dtype, invariant=False, block=block)

    def _fp8_linear_triton_invariant(x, w_fp8, w_scale, out_dtype=None, block=BLOCK):
        if not _supported(x, w_fp8, w_scale, block):
            return _fp8_linear_tiles(x, w_fp8, w_scale, out_dtype, block)
        return _fp8_linear_triton_any(x, w_fp8, w_scale, out_dtype, invariant=True, block=block)
