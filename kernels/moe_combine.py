"""`moe_combine`: the MoE layer's last step, one launch where torch takes about k + 4 (a gather, a clone, k - 1
adds, the shared expert's add, the cast; 9 a layer at k = 6, 36 of a 4-layer decode step's launches).

moe_combine(y [M, D] fp32, inverse [M] int64, top_k, shared [N, D] | None, out_dtype) -> [N, D] out_dtype:
    per_row = y[inverse].view(N, k, D)                      (M = N * k; inverse: the dispatch's sorted position of
                                                             each flat (row, slot), slots in ascending expert id)
    out     = ((per_row[:, 0] + per_row[:, 1]) + ...) + per_row[:, k-1]      fp32 (>= y's dtype), this order
    out     = (out + shared).to(out_dtype)                  (shared upcast to the sum's >= fp32 first)
A row's sum has one fixed order whatever the batch, so the reference is batch-invariant and one Triton kernel
(kernels/moe_combine_triton.py) serves `triton` and `triton_invariant`.
"""

from __future__ import annotations

import torch

from .precision import upcast
from .registry import call

__all__ = ["moe_combine"]


def moe_combine(y: torch.Tensor, inverse: torch.Tensor, top_k: int, shared: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, D] expert outputs in sorted order, inverse [M] -> [M / top_k, D] out_dtype (module docstring)."""
    return call("moe_combine")(y, inverse, top_k, shared, out_dtype)


def _reference(y, inverse, top_k, shared, out_dtype):
    per_row = upcast(y).index_select(0, inverse).view(-1, top_k, y.shape[-1])
    out = per_row[:, 0].clone()
    for j in range(1, top_k):
        out += per_row[:, j]
    if shared is not None:
        out = out + upcast(shared)
    return out.to(out_dtype)
