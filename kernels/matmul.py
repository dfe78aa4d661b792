"""Row-mixing ops behind one dispatch point, and batch-invariant mode.

Every op of the models that puts rows of different sequences into one kernel call goes through here:
`linear` (x W^T), `grouped_linear` (one weight per group of channels), and `row_tiles` for any other
row-local function (mHC mixes, MoE experts, router, batched attention rows).

Normal mode: each helper is the plain torch op, bit for bit what the models computed before.

Batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1, read once on first use; `set_batch_invariant` and the
`batch_invariant()` context manager switch it at run time): the rows are cut into fixed tiles of TILE rows,
the last tile zero-padded, and the op runs once per tile. Every kernel call then has the same shape whatever
the batch, so a row's reduction order (BLAS blocking, split reductions, vector tails of elementwise loops)
cannot depend on how many rows share the forward or where the row sits in it. Measured on CPU (MKL) and
expected of cuBLAS: a GEMM of one fixed shape gives each row the same bits at every position in the tile.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F


TILE = 16        # rows per kernel call in batch-invariant mode
WIDE_TILE = 64   # for row-local work without a GEMM (fewer calls; elementwise loops stay vector-aligned)
ENV = "DEEPINFER_BATCH_INVARIANT"


def env_batch_invariant() -> bool:
    """DEEPINFER_BATCH_INVARIANT (default 0): 1/true/yes/on turns batch-invariant mode on."""
    from deepinfer.env import env_flag
    return env_flag(ENV, False)


_enabled: bool | None = None     # read from the environment on first use (a bad value: one error line there)


def is_batch_invariant() -> bool:
    global _enabled
    if _enabled is None:
        _enabled = env_batch_invariant()
    return _enabled


def set_batch_invariant(on: bool) -> bool:
    """Switch batch-invariant mode for the whole process; returns the previous setting."""
    global _enabled
    before, _enabled = is_batch_invariant(), bool(on)
    return before


@contextlib.contextmanager
def batch_invariant(on: bool = True):
    """Inside: batch-invariant mode is `on`; the previous setting comes back on exit."""
    before = set_batch_invariant(on)
    try:
        yield
    finally:
        set_batch_invariant(before)


def row_tiles(fn: Callable, *rows: torch.Tensor | None, tile: int = TILE):
    """fn(*rows) computed on fixed tiles of `tile` rows (dim 0 of every tensor in `rows`; None passes through).

    The last tile is zero-padded, so every call of fn sees the same shapes; fn must be row-local (output row i
    depends on input row i only) and must accept all-zero rows. fn returns a tensor or a tuple of tensors /
    None, each with the rows on dim 0; the result is the same structure with the padding cut off."""
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


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N] (F.linear; fixed row tiles of the flattened rows when batch-invariant)."""
    if not _enabled:
        return F.linear(x, w)
    flat = x.reshape(-1, x.shape[-1])
    return row_tiles(lambda t: F.linear(t, w), flat).view(*x.shape[:-1], w.shape[0])


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, G, I], w [G, R, I] -> [N, G, R]: group g of every row times its own w[g]^T."""
    if not _enabled:
        return torch.einsum("ngi,gri->ngr", x, w)
    return row_tiles(lambda t: torch.einsum("ngi,gri->ngr", t, w), x)
