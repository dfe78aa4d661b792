"""Batch-invariant dense GEMMs on the Triton expert kernel: `linear` and `grouped_linear` for `triton_invariant`.

The `invariant` implementations cut the rows into tiles of 16 and call cuBLAS once per tile (kernels/tiles.py),
so a 256-row decode step reads every projection's weights 16 times: on the H200 the invariant V4.1
step at b256 made 1685 launches against the default's 590 and took 1.80x its time, most of the difference in
those per-tile GEMMs. The expert kernel (kernels/experts_triton.py) with its one fixed configuration is
batch-invariant by construction: a row's products are summed over K in the same order whatever rows share its
tile, and nothing in the launch depends on the row count but the grid. So:
    linear(x [.., K], w [N, K])            = one expert over every row, bf16 out (the reference's rounding)
    grouped_linear(x [R, G, I], w [G, O, I]) = one expert per group (rows grouped by g), out [R, G, O]
Both read the weights once per BM = 64 rows (dense weights keep INVARIANT's BM 64 tiles).

In `triton_invariant` since their `-m gpu` gate passed (tests/test_kernels_matmul_triton.py with
tests/test_batch_invariant.py; docs/results.md has the run).
"""

from __future__ import annotations

import torch

from . import experts_triton as et
from .experts import ExpertWeights
from .matmul import _grouped_tiles, _linear_tiles


def supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    if et.triton is None or not (x.is_cuda or et.interpreting()) or x.dtype != w.dtype or x.device != w.device:
        return False
    return x.dtype in (torch.bfloat16, torch.float16) or (et.interpreting() and x.dtype == torch.float32)


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, rows_per_group: int) -> torch.Tensor:
    """x [G * M, K] (rows of group g at g*M ..), w [G, N, K] -> [G * M, N] in x's dtype: each group's rows times
    its own w[g]^T, accumulated in fp32 and rounded once, on INVARIANT tiles."""
    g, n, k = w.shape
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    ew = ExpertWeights(w, w, w, dtype=x.dtype, limit=0.0)
    table = uniform_tiles(g, rows_per_group, et.INVARIANT.bm, x.device)
    unit = torch.ones(1, dtype=torch.float32, device=x.device)             # route weights: read by gated launches only
    et._launch(x, w, None, None, None, unit, out, table, n, k, ew, False, et.INVARIANT)
    return out


def uniform_tiles(groups: int, rows: int, bm: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts_triton.tile_table for `groups` groups of `rows` rows each, from the shapes (a few launches instead
    of the general table's searchsorted / cumsum): int32 (tile's group, its first row, its row count)."""
    per = -(-rows // bm)
    t = torch.arange(groups * per, dtype=torch.int32, device=device)
    group = t // per
    j = (t - group * per) * bm
    return group, group * rows + j, (rows - j).clamp_(max=bm)


def linear_invariant(x, w):
    if not supported(x, w):
        return _linear_tiles(x, w)
    flat = x.reshape(-1, x.shape[-1])
    return grouped_gemm(flat, w.unsqueeze(0), flat.shape[0]).view(*x.shape[:-1], w.shape[0])


def grouped_linear_invariant(x, w):
    if not supported(x, w):
        return _grouped_tiles(x, w)
    r, g, i = x.shape
    grouped = x.transpose(0, 1).reshape(g * r, i)                            # [G * R, I], group-major
    return grouped_gemm(grouped, w, r).view(g, r, w.shape[1]).transpose(0, 1)
