"""Triton `softmax_pool` (the contract: kernels/softmax_pool.py) for both Triton sets: program (n, c) holds row
n's window, every slot over BLOCK_D channels, and pools it in registers: the slots' max, exp, sum, then the
weighted sum of kv. One launch where torch takes three (softmax, product, sum). Row-local, so batch-invariant as
it is; exp is the kernels' own, so within an ulp or two of torch's softmax, not its bits
(tests/interpreted/test_softmax_pool_triton.py).
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device, pow2
from .pdl import pdl
from .softmax_pool import _softmax_pool

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

BLOCK_ELEMENTS = 4096        # slots x channels a program holds (each of kv and score)

if triton is not None:

    @triton.jit
    def _softmax_pool_kernel(kv_ptr, score_ptr, out_ptr, S, D, kv_n, kv_s, sc_n, sc_s,
                             S_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """out [N, D] row n, columns [c * BLOCK_D, +BLOCK_D) = sum_s kv[n, s] * softmax_s(score[n, :, col])."""
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        slots = tl.arange(0, S_PAD)
        ok = (slots < S)[:, None] & (cols < D)[None, :]
        score = tl.load(score_ptr + n * sc_n + slots[:, None] * sc_s + cols[None, :], mask=ok,
                        other=float("-inf")).to(tl.float32)
        score = tl.where((cols < D)[None, :], score, 0.0)                # columns past D: finite, never stored
        kv = tl.load(kv_ptr + n * kv_n + slots[:, None] * kv_s + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        e = tl.exp(score - tl.max(score, axis=0)[None, :])                  # padding slots: exp(-inf) = 0
        p = e / tl.sum(e, axis=0)[None, :]
        tl.store(out_ptr + n * D + cols, tl.sum(kv * p, axis=0), mask=cols < D)

    INTERPRETED = is_interpreted(_softmax_pool_kernel)
else:
    INTERPRETED = False


def softmax_pool_triton(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    if triton is None or not on_kernel_device(INTERPRETED, kv, score) or kv.dim() != 3 or kv.shape != score.shape \
            or kv.dtype != torch.float32 or score.dtype != torch.float32 or kv.stride(2) != 1 or score.stride(2) != 1:
        return _softmax_pool(kv, score)                   # float64 and the rest: the reference
    n, s, d = kv.shape
    out = torch.empty((n, d), dtype=torch.float32, device=kv.device)
    if n and d and s:
        s_pad = pow2(s, 1)
        block_d = max(16, min(pow2(d), BLOCK_ELEMENTS // s_pad))
        _softmax_pool_kernel[(n, triton.cdiv(d, block_d))](kv, score, out, s, d, kv.stride(0), kv.stride(1),
                                                           score.stride(0), score.stride(1), S_PAD=s_pad,
                                                           BLOCK_D=block_d, num_warps=4, **pdl(kv.device))
    elif n and d:
        return _softmax_pool(kv, score)
    return out
