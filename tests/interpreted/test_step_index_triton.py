"""kernels/step_index_triton.py in Triton's interpreter against the torch reference (kernels/step_index.py): the same
integers on random step layouts: segments of 1 to 9 rows at positions 0 to 300 (rows before position 0, rows
inside and before their segment, windows longer than the segment), row subsets, counts and index widths that are
not a multiple of a block, rows closing no entry, write floors above and below the rows, the block column clamped."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import step_index as ref
from deepinfer.kernels import step_index_triton as kt


@pytest.fixture(autouse=True)
def _kernels_interpreted():
    assert kt.INTERPRETED, "triton was imported before TRITON_INTERPRET=1: the functions would run the reference"

SCRATCH = -5                 # not a slot, block or table value of the cases: scratch rows are told apart


def _layout(seed: int, segments: int, slots: int = 7):
    """Per-row pos, start (segment start a), first (segment's first row o), slot, seg, end (a + n) [N] int64."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 10, (segments,), generator=g)
    starts = torch.randint(0, 300, (segments,), generator=g)
    seg_slots = torch.randperm(slots, generator=g)[:segments] if segments <= slots else \
        torch.randint(0, slots, (segments,), generator=g)
    row_seg = torch.repeat_interleave(torch.arange(segments), lens)
    first = torch.cumsum(lens, 0) - lens
    pos = starts[row_seg] + torch.arange(row_seg.shape[0]) - first[row_seg]
    return dict(pos=pos, start=starts[row_seg], first=first[row_seg], slot=seg_slots[row_seg], seg=row_seg,
                end=(starts + lens)[row_seg], n=row_seg.shape[0], g=g)


def _rows(lay, subset: bool):
    if not subset:
        return None
    return torch.randperm(lay["n"], generator=lay["g"])[: max(1, lay["n"] // 2)]


@pytest.mark.parametrize("segments,count,span,subset", [(1, 1, 1, False), (3, 4, 4, False), (5, 128, 128, False),
                                                        (4, 5, 8, True), (6, 1100, 2048, True), (2, 3, 2, True)])
def test_ring_index(segments, count, span, subset):
    lay = _layout(segments * 31 + count, segments)
    rows = _rows(lay, subset)
    for ring, base in ((lay["slot"], 7 * span), (lay["seg"], segments * span)):
        want = ref._ring_index(lay["pos"], lay["start"], lay["first"], ring, rows, base, count, span)
        got = kt.ring_index_triton(lay["pos"], lay["start"], lay["first"], ring, rows, base, count, span)
        assert got.dtype == torch.long and torch.equal(got, want)
        picked = lay["pos"] if rows is None else lay["pos"][rows]
        assert bool((want == -1).any()) == bool((picked < count - 1).any())    # -1 exactly before position 0


@pytest.mark.parametrize("segments,span", [(1, 1), (4, 4), (9, 128), (3, 2)])
def test_ring_slots(segments, span):
    lay = _layout(segments * 7 + span, segments)
    want = ref._ring_slots(lay["pos"], lay["end"], lay["slot"], span, SCRATCH)
    got = kt.ring_slots_triton(lay["pos"], lay["end"], lay["slot"], span, SCRATCH)
    assert all(a.dtype == torch.long and torch.equal(a, b) for a, b in zip(got, want))
    assert (want[0] == SCRATCH).any() == (lay["pos"] < lay["end"] - span).any()


def _pools(lay, slots=7, max_blocks=6, blocks=40):
    g = lay["g"]
    table = torch.randint(0, blocks, (slots, max_blocks), generator=g, dtype=torch.int32)
    floor = torch.randint(0, 200, (slots,), generator=g)
    floor[0] = 0
    return table, floor


@pytest.mark.parametrize("segments,ratio,per_block,subset", [(3, 4, 16, False), (5, 2, 32, True), (2, 1, 64, False),
                                                             (8, 128, 1, True), (4, 2, 8, False)])
def test_entry_slots(segments, ratio, per_block, subset):
    lay = _layout(segments * 13 + ratio, segments)
    table, floor = _pools(lay)
    rows = _rows(lay, subset)
    first = 0 if rows is None else int(rows[0])       # that row closes a window and writes above its floor
    lay["pos"] += (ratio - 1 - int(lay["pos"][first])) % ratio
    floor[lay["slot"][first]] = 0
    last = lay["n"] - 1 if rows is None else int(rows[-1])
    floored = bool(lay["slot"][last] != lay["slot"][first])
    if floored:                                         # another slot's row: below its floor
        floor[lay["slot"][last]] = int(lay["pos"][last]) + 1
    block_tokens = ratio * per_block          # as the pools lay blocks out; (4, 2, 8): 16-position blocks
    args = (lay["pos"], lay["slot"], rows, table, floor, ratio, per_block, block_tokens, SCRATCH)
    want, got = ref._entry_slots(*args), kt.entry_slots_triton(*args)
    assert all(a.dtype == torch.long and torch.equal(a, b) for a, b in zip(got, want))
    assert (want[0] != SCRATCH).any()                                        # written rows
    picked = lay["pos"] if rows is None else lay["pos"][rows]
    closes = (picked + 1) % ratio == 0
    if ratio > 1:
        assert bool((~closes).any()) and bool((want[0][~closes] == SCRATCH).all())    # rows closing no window
    below = picked < floor[lay["slot"] if rows is None else lay["slot"][rows]]
    assert bool((want[0][below] == SCRATCH).all())                                 # rows below their floor
    assert bool(below.any()) or not floored
    if per_block == 8:                        # positions past the 6 columns' 96: the column clamp is in the case
        assert (picked // block_tokens > table.shape[1] - 1).any()


@pytest.mark.parametrize("segments,ratio,per_block,ctx_blocks,subset", [(3, 4, 16, 2, False), (5, 2, 32, 6, True),
                                                                        (2, 1, 64, 8, False), (4, 128, 1, 3, True),
                                                                        (6, 4, 300, 5, False)])
def test_entry_index(segments, ratio, per_block, ctx_blocks, subset):
    lay = _layout(segments * 17 + ratio + ctx_blocks, segments)
    table, _ = _pools(lay)
    rows = _rows(lay, subset)
    args = (lay["pos"], lay["slot"], rows, table, ctx_blocks, ratio, per_block)
    want, got = ref._entry_index(*args), kt.entry_index_triton(*args)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert want.shape[1] == min(ctx_blocks, table.shape[1]) * per_block      # ctx_blocks 8 > 6 columns: clamped


@pytest.mark.parametrize("c,j,k", [(1, 512, 6), (5, 64, 8), (37, 300, 3), (200, 40, 40)])
def test_entry_pick(c, j, k):
    g = torch.Generator().manual_seed(c * j + k)
    index = torch.randint(0, 10_000, (c, j), generator=g)
    index[torch.rand(c, j, generator=g) < 0.2] = -1                    # invisible entries: -1 in the index
    top = torch.stack([torch.randperm(j, generator=g)[:k] for _ in range(c)])
    top[torch.rand(c, k, generator=g) < 0.3] = -1                      # fewer than k picks
    want, got = ref._entry_pick(index, top), kt.entry_pick_triton(index, top)
    assert got.dtype == torch.long and torch.equal(got, want)
    assert (want == -1).any() and (want >= 0).any()
