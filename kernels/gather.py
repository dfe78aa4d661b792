"""`gather_rows`: rows of a two-part store by index, a fill where the index is -1, in one launch where torch takes
five (the store's copy and concatenation, the clamp, the gather, the select).

gather_rows(store, index [C, K] int64, fill) -> [C, K, w] in the store's dtype:
    store: a kernels.attention.SplitStore (ring [R, w]: a ring pool flattened, read in place; new [N, w]: this
           step's rows, cast to the ring's dtype) or one tensor [M, w]
    out[c, k] = row index[c, k] of the store (i < R: ring[i], else new[i - R]), `fill` where index[c, k] < 0
Data movement only: every backend gives the same bits. A compressor's open windows are its pending rings' rows of
each row's last `span` positions (models/common/pooled.py `open_windows`: two calls a compressor per step), and
V4.1's engram look-back is its token-id ring's (one call a step).
"""

from __future__ import annotations

import torch

from .attention import SplitStore, store_rows
from .registry import call

__all__ = ["gather_rows"]


def gather_rows(store: SplitStore | torch.Tensor, index: torch.Tensor, fill: float) -> torch.Tensor:
    """Rows index [C, K] (-1: `fill`) of store (a SplitStore or [M, w]) -> [C, K, w] (module docstring)."""
    return call("gather_rows")(store, index, fill)


def _gather_rows(store, index, fill):
    # the rows in place (no copy of the ring pool); a store with no step rows is its ring
    if isinstance(store, SplitStore) and store.new.shape[0] == 0:
        store = store.ring
    rows = store_rows(store, index.clamp(min=0)).to(store.dtype)
    return torch.where((index >= 0).unsqueeze(-1), rows, fill)
