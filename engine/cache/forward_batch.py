"""One step's rows over the state pools: where each row's inputs and state live, as index tensors.

A step feeds G segments; segment g is n_g new tokens of the sequence in slot s_g that already holds a_g
positions, so its rows (o_g .. o_g + n_g - 1 of the flat batch of N rows) sit at positions a_g .. a_g + n_g - 1.
Prefill chunks, decode rows (n = 1) and verify rows (n = q + 1) are all segments; each row attends causally.

A position tp < a_g of segment g lives in the pools, a position tp >= a_g in this step's rows. Every ring (an
attention window, a compressor's pending rows, a look-back of token ids) is read in place (`window_index`: rows of
a kernels.attention.SplitStore of the flattened ring, then the step's new values; -1 before position 0) and
written after the read. Rows write rings only for the last `span` positions of their segment (the others would
collide); writes that must go nowhere land on scratch slot / block 0.

A ragged batch may mark segments `last_only`: only their last row's output is needed, so a model that can
(V4.1's YOCO truncation) runs its later layers on a shrinking suffix of those segments (`keep_last`), or, with
`keep_tokens` (compact truncation, approximate), on their last keep_tokens rows.

Three ways to build one: `ragged` (host lists of any segment sizes; compact per-step lists, e.g. only the rows
that close a compressor window), `uniform` (G segments of q rows from device tensors, static shapes: what a
CUDA graph captures; every row where a ragged step lists some) and `varlen` (G segments whose lengths are a device
tensor, N rows in all: a variable-length verify step under a CUDA graph). The static kinds write every row's
ring entry: their segments are at most a ring long (speculation gives every ring draft-length slack). Index
tensors are built once per step, on first use, and shared by every layer.
"""

from __future__ import annotations

import torch

from deepinfer.kernels import step_index

from .pools import SCRATCH, StatePools


class ForwardBatch:
    def __init__(self, pools: StatePools, seg_slots: torch.Tensor, seg_starts: torch.Tensor,
                 row_seg: torch.Tensor, row_pos: torch.Tensor, seg_first_row: torch.Tensor, seg_ends: torch.Tensor,
                 ctx_blocks: int, host: tuple[list[int], list[int], list[int]] | None,
                 last_only: list[bool] | None = None, root_rows: int | None = None, draft_rings: bool = False,
                 row_share=None, keep_tokens: int | None = None, ring_marks=(), one_row_segments: bool = False):
        """one_row_segments: row g is segment g (a decode step): the per-row tensors are the segments' own."""
        self.pools = pools
        self.seg_slots, self.seg_starts = seg_slots, seg_starts       # [G] int64
        self.row_seg, self.positions = row_seg, row_pos               # [N] int64
        per_row = (lambda t: t) if one_row_segments else (lambda t: t[row_seg])
        self.row_slot = per_row(seg_slots)                            # [N]
        self.row_start = per_row(seg_starts)                          # [N] a of the row's segment
        self.row_first = per_row(seg_first_row)                       # [N] o of the row's segment
        self.row_end = per_row(seg_ends)                              # [N] a + n of the row's segment
        self.num_segments, self.num_rows = seg_slots.shape[0], row_pos.shape[0]
        self.ctx_blocks = ctx_blocks
        self.host = host                                              # (slots, starts, lens) when ragged
        self.last_only = last_only                                    # [G] host flags, ragged only
        self.keep_tokens = keep_tokens      # compact truncation: a last_only segment's rows kept (None: exact)
        self.root_rows = self.num_rows if root_rows is None else root_rows   # rows of the step's full batch
        self.draft_rings = draft_rings                                # keep the model's draft rings current
        self.shared: dict = {}                                        # per-step products layers share (V4.1 groups)
        self.row_share = row_share          # the step's rows shared over context-parallel ranks (None: all ours)
        self.ring_marks = tuple(ring_marks)  # (segment, position B, snapshot seat): rings as after B go there too
        self._cache: dict = {}

    # ---- construction ----
    @classmethod
    def ragged(cls, pools: StatePools, slots: list[int], starts: list[int], lens: list[int],
               ctx_blocks: int, last_only: list[bool] | None = None, root_rows: int | None = None,
               draft_rings: bool = False, row_share=None, keep_tokens: int | None = None,
               ring_marks=()) -> "ForwardBatch":
        """row_share: the rows are shared over context-parallel ranks (parallel/context_parallel.py: its `rows` [Q]
        are the rows this rank computes, its `gather(x [Q, ...]) -> [N, ...]` every rank's). ring_marks: (g, B,
        seat): segment g's rings as they are after its position B (B - span' >= its start: every ring row at B is
        one of its rows) are written into ring snapshot seat `seat` as well (prefix caching's interior
        snapshots)."""
        dev = pools.device
        first = _offsets(lens)
        row_seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        row_pos = torch.tensor(starts)[row_seg] + torch.arange(row_seg.shape[0]) - torch.tensor(first)[row_seg]
        seg = torch.tensor([slots, starts, first, [a + n for a, n in zip(starts, lens)]], dtype=torch.long)
        seg = seg.to(dev, non_blocking=True)
        rows = torch.stack([row_seg, row_pos]).to(dev, non_blocking=True)
        return cls(pools, seg[0], seg[1], rows[0], rows[1], seg[2], seg[3], ctx_blocks,
                   (list(slots), list(starts), list(lens)), last_only, root_rows, draft_rings, row_share, keep_tokens,
                   ring_marks)

    def keep_last(self, keep: list[int]) -> tuple["ForwardBatch", torch.Tensor]:
        """The batch of each segment's last keep[g] rows, and those rows' indices [M] in this batch."""
        slots, starts, lens = self.host
        rows, o = [], 0
        for n, k in zip(lens, keep):
            rows.extend(range(o + n - k, o + n))
            o += n
        if any(keep[g] != lens[g] for g, _, _ in self.ring_marks):
            raise RuntimeError("internal: a segment with ring marks was truncated")
        sub = ForwardBatch.ragged(self.pools, slots, [a + n - k for a, n, k in zip(starts, lens, keep)], list(keep),
                                  self.ctx_blocks, self.last_only, self.root_rows, keep_tokens=self.keep_tokens,
                                  ring_marks=self.ring_marks)   # a marked segment keeps every row: the same marks
        sub.shared = self.shared                 # the source group's products outlive the cut
        return sub, torch.tensor(rows, dtype=torch.long).to(self.positions.device, non_blocking=True)

    @classmethod
    def uniform(cls, pools: StatePools, seg_slots: torch.Tensor, seg_starts: torch.Tensor, q: int,
                ctx_blocks: int, draft_rings: bool = False) -> "ForwardBatch":
        """G = len(seg_slots) segments of q rows each; seg_* are device tensors (static buffers under graphs)."""
        g = seg_slots.shape[0]
        if q == 1:                       # decode: row g is segment g at its start (2 launches where q > 1 takes 12)
            rows = torch.arange(g, device=seg_slots.device)
            return cls(pools, seg_slots, seg_starts, rows, seg_starts, rows, seg_starts + 1, ctx_blocks, None,
                       draft_rings=draft_rings, one_row_segments=True)
        rows = torch.arange(g * q, device=seg_slots.device)
        row_seg = rows // q
        first = torch.arange(g, device=seg_slots.device) * q
        return cls(pools, seg_slots, seg_starts, row_seg, seg_starts[row_seg] + rows % q, first, seg_starts + q,
                   ctx_blocks, None, draft_rings=draft_rings)

    @classmethod
    def varlen(cls, pools: StatePools, seg_slots: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
               num_rows: int, ctx_blocks: int, draft_rings: bool = False) -> "ForwardBatch":
        """G segments of seg_lens[g] rows each (device tensors summing to num_rows; a length may be 0): static
        shapes whatever the lengths, what a CUDA graph of a variable-length verify step captures. Every row's
        segment is found on the device (searchsorted over the segment ends), so nothing waits on the host."""
        dev = seg_slots.device
        ends = torch.cumsum(seg_lens, 0)                                           # [G] o_g + n_g
        first = ends - seg_lens                                                    # [G] o_g
        rows = torch.arange(num_rows, device=dev)
        row_seg = torch.searchsorted(ends, rows, right=True).clamp(max=seg_slots.shape[0] - 1)
        return cls(pools, seg_slots, seg_starts, row_seg, seg_starts[row_seg] + rows - first[row_seg], first,
                   seg_starts + seg_lens, ctx_blocks, None, draft_rings=draft_rings)

    # ---- rows shared over context-parallel ranks ----
    @property
    def query_rows(self) -> torch.Tensor | None:
        """The rows [Q] whose outputs this process computes (None: every row). The state is written from every row;
        only context-parallel prefill (parallel/context_parallel.py) shares a step's rows out."""
        return None if self.row_share is None else self.row_share.rows

    def all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [Q, ...] of the query rows -> [N, ...] of every row: x itself unless the rows are shared, else every
        rank's rows gathered (one collective). What a layer that mixes positions reads its input through."""
        return x if self.row_share is None else self.row_share.gather(x)

    @property
    def is_static(self) -> bool:
        return self.host is None

    def rotary(self, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """rope(positions) (cos, sin [N, rope_dim/2]) for this step's rows, computed once per rope module: the
        layers sharing a RotaryEmbedding share its tables."""
        return self._cached(("rope", id(rope)), lambda: rope(self.positions))

    def _cached(self, key, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    # ---- reading rings in place: positions -> rows of a SplitStore ----
    def window_index(self, count: int, span: int, ring_rows: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """For each row in `rows` [C] (None: every row) at position p, the `count` positions p-count+1 .. p (oldest
        first) as rows of a kernels.attention.SplitStore: a position before the row's segment start is its ring
        row slot * span + tp % span of the ring pool flattened (ring_rows = slots * span rows, read in place: the
        ring is written after the read), a position of this step is ring_rows + its row -> [C, count] int64, -1
        before 0."""
        return self._cached(("window", None if rows is None else id(rows), count, span, ring_rows),
                            lambda: step_index.ring_index(self.positions, self.row_start, self.row_first,
                                                          self.row_slot, rows, ring_rows, count, span))

    # ---- writing rings ----
    def write_ring(self, ring: torch.Tensor, new: torch.Tensor) -> None:
        """Row values new [N, w] to ring [S, span, w] at p % span, for each segment's last `span` positions."""
        span = ring.shape[1]
        slot, at = self._cached(("ring_slot", span), lambda: step_index.ring_slots(
            self.positions, self.row_end, self.row_slot, span, SCRATCH))
        ring[slot, at] = new.to(ring.dtype)
        if self.ring_marks:
            rows, seats = self._cached(("marks", span), lambda: self._mark_rows(span))
            self.pools.snapshot_store(ring)[seats, self.positions[rows] % span] = new[rows].to(ring.dtype)

    def _mark_rows(self, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [M] whose values a ring of `span` rows holds after each mark's position, and their seats [M]."""
        _, starts, lens = self.host
        first = _offsets(lens)
        rows, seats = [], []
        for g, at, seat in self.ring_marks:
            if not starts[g] + span <= at < starts[g] + lens[g]:
                raise RuntimeError(f"internal: a ring mark at {at} needs rows its segment {g} does not have")
            rows.extend(range(first[g] + at - starts[g] - span, first[g] + at - starts[g]))
            seats.extend([seat] * span)
        dev = self.positions.device
        return (torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor(seats, dtype=torch.long).to(dev, non_blocking=True))

    def last_rows(self, span: int) -> torch.Tensor:
        """Rows at each segment's last `span` positions (the ones whose ring writes stay) -> [M] int64. Static:
        every row (a uniform step's q rows are within any window)."""
        if self.is_static:
            return torch.arange(self.num_rows, device=self.positions.device)
        rows, o = [], 0
        for n in self.host[2]:
            rows.extend(range(o + max(0, n - span), o + n))
            o += n
        return torch.tensor(rows, dtype=torch.long).to(self.positions.device, non_blocking=True)

    def write_ring_rows(self, ring: torch.Tensor, rows: torch.Tensor, new: torch.Tensor) -> None:
        """Values new [M, w] of `rows` (each segment's last ring.shape[1] positions at most) into ring at p % span."""
        ring[self.row_slot[rows], self.positions[rows] % ring.shape[1]] = new.to(ring.dtype)

    # ---- compressed entries ----
    @staticmethod
    def picked(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """t [N, ...] at `rows` [C] (None: every row, no launch) -> [C, ...]."""
        return t if rows is None else t[rows]

    def closing_rows(self, ratio: int) -> torch.Tensor | None:
        """Rows whose position closes a window of `ratio` positions ((p + 1) % ratio == 0) -> [C] int64, a compact
        list when ragged; None when static (every row, the ones closing none written to scratch by `write_entries`
        and pooled for nothing, which costs no launch where a mask would cost four) or when every row closes one
        (ratio 1)."""
        if self.is_static or ratio == 1:                     # ratio 1: every row closes its own window
            return None
        return self._cached(("close", ratio), lambda: self._closing_rows(ratio))

    def _closing_rows(self, ratio: int) -> torch.Tensor:
        rows, o = [], 0
        for a, n in zip(self.host[1], self.host[2]):
            first = a + (-(a + 1)) % ratio                    # first position >= a with (p + 1) % ratio == 0
            rows.extend(range(o + first - a, o + n, ratio))
            o += n
        return torch.tensor(rows, dtype=torch.long).to(self.positions.device, non_blocking=True)

    def window_starts(self, rows: torch.Tensor | None, ratio: int) -> torch.Tensor:
        """The first position of the window each row of `rows` (`closing_rows`) closes, p + 1 - ratio -> [C] (a
        static step's rows closing none get a value whose entry goes to scratch)."""
        pos = self.picked(self.positions, rows)
        return pos if ratio == 1 else pos + (1 - ratio)

    def write_entries(self, store: torch.Tensor, rows: torch.Tensor | None, ratio: int, new: torch.Tensor) -> None:
        """Entries new [C, w] of `rows` (`closing_rows`; None: every row) into store [NB, E, w] at entry p // ratio
        of each row's sequence; a row closing no window, and one below its slot's write floor (a prefix hit's
        replay), to scratch block 0."""
        per_block = store.shape[1]
        block, at = self._cached(("entry_rows", None if rows is None else id(rows), ratio, per_block),
                                 lambda: self._entry_rows(rows, ratio, per_block))[:2]
        store[block, at] = new.to(store.dtype)

    def _entry_rows(self, rows: torch.Tensor | None, ratio: int, per_block: int):
        """(store block, row in the block) of the entries `rows` close (rows closing none and those below their
        slot's write floor to scratch), and rows itself (kept alive with the step's cache, so the id in its key
        stays its): the stores of one ratio share them."""
        pools = self.pools
        block, at = step_index.entry_slots(self.positions, self.row_slot, rows, pools.block_table, pools.write_floor,
                                           ratio, per_block, pools.block_tokens, SCRATCH)
        return block, at, rows

    def entry_index(self, ratio: int, per_block: int) -> torch.Tensor:
        """[N, J] rows of the flattened entry store [NB * per_block, w] of entries 0 .. J-1 of each row's
        sequence, -1 where not yet visible (entry j is visible at p once j < (p + 1) // ratio). J covers
        ctx_blocks block-table columns."""
        return self._cached(("entries", ratio, per_block), lambda: self._entry_index(ratio, per_block))

    def entry_index_of(self, ratio: int, per_block: int, rows: torch.Tensor) -> torch.Tensor:
        """entry_index for the rows `rows` [R] only (not cached): [R, J]. What a caller that walks long prefills in
        row blocks builds, so no [N, J] index exists at once."""
        return self._entry_index(ratio, per_block, rows)

    def _entry_index(self, ratio: int, per_block: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        return step_index.entry_index(self.positions, self.row_slot, rows, self.pools.block_table, self.ctx_blocks,
                                      ratio, per_block)


def _offsets(lens: list[int]) -> list[int]:
    """Each segment's first row in the flat batch: the running sum of the lengths before it."""
    first = [0]
    for n in lens[:-1]:
        first.append(first[-1] + n)
    return first
