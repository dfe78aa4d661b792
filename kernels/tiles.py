"""Fixed row tiles: how the `invariant` backends make a row's result independent of its batch.

The rows are cut into tiles of TILE rows, the last one zero-padded, and the op runs once per tile. Every kernel
call then has the same shape whatever the batch, so a row's reduction order (BLAS blocking, split reductions,
vector tails of elementwise loops) cannot depend on how many rows share the call or where the row sits in it.
Measured on CPU (MKL) and expected of cuBLAS: a GEMM of one fixed shape gives each row the same bits at every
position in the tile."""

from __future__ import annotations

from typing import Callable

import torch

TILE = 16        # rows per kernel call
WIDE_TILE = 64   # for row-local work without a GEMM (fewer calls; elementwise loops stay vector-aligned)


def row_tiles(fn: Callable, *rows: torch.Tensor | None, tile: int = TILE):
    """fn(*rows) computed on fixed tiles of `tile` rows (dim 0 of every tensor in `rows`; None passes through).

    fn must be row-local (output row i depends on input row i only) and must accept all-zero rows. It returns
    a tensor or a tuple of tensors / None, each with the rows on dim 0; the result is the same structure with
    the padding cut off."""
    n = next(r.shape[0] for r in rows if r is not None)
    if n == tile or n == 0:
        return fn(*rows)
    pad = -n % tile
    if pad:
        rows = tuple(None if r is None else torch.cat([r, r.new_zeros((pad,) + r.shape[1:])]) for r in rows)
    outs = [fn(*(None if r is None else r[a:a + tile] for r in rows)) for a in range(0, n + pad, tile)]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)[:n]
    return tuple(None if parts[0] is None else torch.cat(parts)[:n] for parts in zip(*outs))
