"""Dense linear ops: `linear` (x W^T), `linear_f32` (x W^T in >= fp32 whatever the dtypes: the LM heads, the
compressor projections) and `grouped_linear` (one weight per group of channels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .precision import upcast
from .registry import call
from .tiles import row_tiles

MIXED_TILE = 64   # rows per fp32-output GEMM call of the invariant linear_f32 on CUDA


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N]."""
    return call("linear")(x, w)


def linear_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T accumulated and returned in >= fp32 (float64 stays float64) -> [..., N]."""
    return call("linear_f32")(x, w)


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, G, I], w [G, R, I] -> [N, G, R]: group g of every row times its own w[g]^T."""
    return call("grouped_linear")(x, w)


def _linear(x, w):
    return F.linear(x, w)


def _linear_tiles(x, w):
    flat = x.reshape(-1, x.shape[-1])
    return row_tiles(lambda t: F.linear(t, w), flat).view(*x.shape[:-1], w.shape[0])


def _linear_f32(x, w):
    return F.linear(upcast(x), upcast(w))


def _linear_f32_tiles(x, w):
    """Fixed row tiles. 16-bit x and w of one dtype on CUDA: the triton backend's fp32-output cuBLAS GEMM per
    tile of MIXED_TILE rows (the weight is read once per tile: 64 rows keep a 1 GB LM head's GEMM memory-bound,
    so one tile costs what one row does); otherwise w upcast once, then the reference per tile (upcasting per
    tile copied the head 16 times a step at 256 rows: 36% of the invariant step's GPU time on the H200)."""
    flat = x.reshape(-1, x.shape[-1])
    if _mixed(x, w):
        out = row_tiles(lambda t: _mm_f32(t, w), flat, tile=MIXED_TILE)
    else:
        w32 = upcast(w)
        out = row_tiles(lambda t: F.linear(upcast(t), w32), flat)
    return out.view(*x.shape[:-1], w.shape[0])


def _mixed(x, w) -> bool:
    return x.is_cuda and x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)


def _mm_f32(x2d, w):
    """x2d [M, K] @ w [N, K]^T as one cuBLAS GEMM accumulating in fp32, fp32 out."""
    return torch.mm(x2d, w.t(), out_dtype=torch.float32)


def _linear_f32_mixed(x, w):
    """16-bit x and w of one dtype on CUDA: one cuBLAS GEMM accumulating in fp32 with an fp32 output
    (torch.mm's out_dtype), so no step makes an fp32 copy of w (the LM head's 1 GB bf16 weight became 2 GB each
    step: 0.75 ms of copy plus a 2 GB GEMV at V4 flash width). A product of two 16-bit floats is exact in fp32,
    so only the summation order differs from the reference. Anything else: the reference."""
    if not _mixed(x, w):
        return _linear_f32(x, w)
    return _mm_f32(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


def _grouped(x, w):
    return torch.einsum("ngi,gri->ngr", x, w)


def _grouped_tiles(x, w):
    return row_tiles(lambda t: torch.einsum("ngi,gri->ngr", t, w), x)
