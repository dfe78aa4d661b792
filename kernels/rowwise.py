"""`rowwise(fn, *rows)`: a row-local function the model defines (router scores, engram gate) run as the
active backend runs row-local work: as it is (reference) or on fixed row tiles (invariant)."""

from __future__ import annotations

from typing import Callable

from .registry import call
from .tiles import WIDE_TILE, row_tiles


def rowwise(fn: Callable, *rows, wide: bool = False):
    """fn(*rows) for row-local fn (output row i depends on input row i only; all-zero rows allowed).
    wide=True: the work has no GEMM (elementwise only), so the invariant backend may use wider tiles."""
    return call("rowwise")(fn, *rows, wide=wide)


def _plain(fn, *rows, wide=False):
    return fn(*rows)


def _tiles(fn, *rows, wide=False):
    return row_tiles(fn, *rows, tile=WIDE_TILE) if wide else row_tiles(fn, *rows)
