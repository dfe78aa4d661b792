"""Reading state out of the pools for attention, shared by the V4 and V4.1 layers: index lists, never copies of
whole pools (cache/forward_batch.py builds the indices)."""

from __future__ import annotations

import torch

from deepinfer.kernels.attention import SplitStore
from deepinfer.kernels.gather import gather_rows
from deepinfer.kernels.indexer import top_k_indices
from deepinfer.kernels.step_index import entry_pick

from ...cache.forward_batch import ForwardBatch

SELECT_BLOCK_ELEMENTS = 1 << 26      # [rows, J] elements of a selection's index and scores at once (12 B each)


def window_source(batch: ForwardBatch, ring: torch.Tensor, new: torch.Tensor, count: int,
                  rows: torch.Tensor | None = None) -> tuple[SplitStore, torch.Tensor]:
    """Each row's last `count` positions p-count+1 .. p (oldest first) of a ring [S, W, w] as it was before this
    step, read in place, and of this step's values new [N, w] (rows [C]: those rows only; None: every row) ->
    (SplitStore of the ring pool and new, index [C, count], -1 before position 0): a sparse-attention source, or
    what `gather_rows` reads. The caller writes new into the ring after the read (batch.write_ring): a row's ring
    write would overwrite a slot an earlier row of the step still reads."""
    flat = ring.flatten(0, 1)                                                       # a view: [S * W, w]
    return SplitStore(flat, new.to(ring.dtype)), batch.window_index(count, ring.shape[1], flat.shape[0], rows)


def open_windows(batch: ForwardBatch, name: str, kv: torch.Tensor, score: torch.Tensor, rows: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A compressor's windows: this step's kv, score [N, w] (>= fp32) join the pending rings `{name}.pending_kv` /
    `.pending_score` [S, span, w]; each row in `rows` [C] (None: every row) gets the `span` positions ending at its
    own, oldest first -> (kv, score) [C, span, w]. A slot before position 0 (window 0's predecessor) has kv 0 and
    the lowest finite score, so it weighs 0 and an all-missing window pools to finite garbage, never NaN. The rings
    are read in place, then kv and score are written into them."""
    pend_kv, pend_score = batch.pools.rings[f"{name}.pending_kv"], batch.pools.rings[f"{name}.pending_score"]
    span = batch.pools.spans[f"{name}.pending_kv"]                                  # the ring may hold more
    if pend_score.shape[:2] != pend_kv.shape[:2]:
        raise RuntimeError(f"internal: {name}'s pending rings differ in shape: one window index reads both")
    kv_store, index = window_source(batch, pend_kv, kv, span, rows)                 # index [C, span]
    win_kv = gather_rows(kv_store, index, 0.0)
    win_score = gather_rows(window_source(batch, pend_score, score, span, rows)[0], index,
                            torch.finfo(score.dtype).min)
    batch.write_ring(pend_kv, kv)                # after the reads: a row's write could overwrite a slot they read
    batch.write_ring(pend_score, score)
    return win_kv, win_score


def selected_entries(entry_index: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """entry_index [N, J] store rows of each row's candidate entries, top [N, k] positions into J (-1: none)
    -> the selected store rows [N, k] (-1: none)."""
    return entry_pick(entry_index, top)


def top_entries(batch: ForwardBatch, ratio: int, per_block: int, rows: torch.Tensor | None, score, k: int
                ) -> torch.Tensor:
    """Each query row's k best visible entries as store rows [Q, k] (-1: none), Q = rows [Q] of the step (None:
    every row). score(index [R, J], span) -> the scores [R, J] of the queries span (a slice of the Q) over their
    candidate entries (-1 in index: none). Q x J above SELECT_BLOCK_ELEMENTS goes in blocks of query rows, so a
    long prefill never holds a [Q, J] index or score tensor (the block size depends on J only: rows stay
    independent of their batch)."""
    q = batch.num_rows if rows is None else rows.shape[0]
    step = max(1, SELECT_BLOCK_ELEMENTS // max(batch.ctx_blocks * per_block, 1))
    if q <= step:        # a subset of rows (YOCO's truncated prefill) builds its own [Q, J], not the step's [N, J]
        index = batch.entry_index(ratio, per_block) if rows is None else batch.entry_index_of(ratio, per_block, rows)
        return selected_entries(index, top_k_indices(score(index, slice(None)), k))
    out = []
    for a in range(0, q, step):
        part = torch.arange(a, min(a + step, q), device=batch.positions.device) if rows is None else rows[a:a + step]
        index = batch.entry_index_of(ratio, per_block, part)
        out.append(selected_entries(index, top_k_indices(score(index, slice(a, a + step)), k)))
    return torch.cat(out)
