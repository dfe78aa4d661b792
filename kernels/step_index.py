"""A step's index arithmetic over the state pools (the ops engine/cache/forward_batch.py builds its per-step index
tensors with): integer-only, so every backend gives the same integers and a row's result depends on that row only
(batch-invariant as it is). In torch each is 9-24 small elementwise launches; under a CUDA-graph decode step those
launches were about a fifth of the step's kernels (`deepinfer-bench ops --graph`), so the Triton sets run each op
as one kernel (kernels/step_index_triton.py).

All index tensors are int64 ([N] per row of the step; `rows` [C] a subset of them, None: every row).

ring_index(pos, start, first, ring, rows, base, count, span) -> [C, count]
    for each row at position p: positions tp = p-count+1 .. p (oldest first) as rows of a store whose first
    `base` rows are rings of `span` rows followed by the step's own rows:
        tp >= start:   base + first + tp - start           (the step's row holding tp)
        else:          ring * span + tp % span             (tp's row in the row's ring)
        tp < 0:        -1
ring_slots(pos, end, slot, span, scratch) -> (slot', at) [N] each
    where a row's value goes in a ring of `span` rows: slot' = slot where p >= end - span (the segment's last
    `span` positions) else `scratch`, at = p % span
entry_slots(pos, slot, rows, block_table, write_floor, ratio, per_block, block_tokens, scratch) -> (block, at) [C]
    the entry a row closing a window writes: j = p // ratio lives in block block_table[slot, min(j * ratio //
    block_tokens, max_blocks - 1)] at j % per_block; `scratch` where the row closes none ((p + 1) % ratio != 0: a
    static step passes every row) or p < write_floor[slot]
entry_index(pos, slot, rows, block_table, ctx_blocks, ratio, per_block) -> [C, ctx_blocks * per_block]
    rows of the flattened entry store of entries j = 0 .. J-1 of each row's sequence: table[slot, j // per_block] *
    per_block + j % per_block, -1 where j >= (p + 1) // ratio (not yet closed at p)
entry_pick(index, top) -> [C, k]
    index [C, J] store rows (-1: none), top [C, k] positions into J (-1: none): index[c, top[c, i]], -1 where
    top[c, i] is -1 (a top-k's picks as store rows)
"""

from __future__ import annotations

import torch

from .registry import call

__all__ = ["entry_index", "entry_pick", "entry_slots", "ring_index", "ring_slots"]


def _picked(rows, *tensors):
    return tensors if rows is None else tuple(t[rows] for t in tensors)


def ring_index(pos, start, first, ring, rows, base: int, count: int, span: int) -> torch.Tensor:
    return call("ring_index")(pos, start, first, ring, rows, base, count, span)


def ring_slots(pos, end, slot, span: int, scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return call("ring_slots")(pos, end, slot, span, scratch)


def entry_slots(pos, slot, rows, block_table, write_floor, ratio: int, per_block: int, block_tokens: int,
                scratch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return call("entry_slots")(pos, slot, rows, block_table, write_floor, ratio, per_block, block_tokens, scratch)


def entry_index(pos, slot, rows, block_table, ctx_blocks: int, ratio: int, per_block: int) -> torch.Tensor:
    return call("entry_index")(pos, slot, rows, block_table, ctx_blocks, ratio, per_block)


def entry_pick(index, top) -> torch.Tensor:
    return call("entry_pick")(index, top)


def _entry_pick(index, top):
    return torch.where(top >= 0, index.gather(1, top.clamp(min=0)), -1)


def _ring_index(pos, start, first, ring, rows, base, count, span):
    pos, start, first, ring = _picked(rows, pos, start, first, ring)
    tp = pos.unsqueeze(1) - (count - 1) + torch.arange(count, device=pos.device)          # [C, count]
    new = base + first.unsqueeze(1) + tp - start.unsqueeze(1)
    old = ring.unsqueeze(1) * span + tp % span
    idx = torch.where(tp >= start.unsqueeze(1), new, old)
    return torch.where(tp >= 0, idx, -1)


def _ring_slots(pos, end, slot, span, scratch):
    return torch.where(pos >= end - span, slot, scratch), pos % span


def _entry_slots(pos, slot, rows, block_table, write_floor, ratio, per_block, block_tokens, scratch):
    pos, slot = _picked(rows, pos, slot)
    j = pos // ratio
    col = (j * ratio) // block_tokens
    block = block_table[slot, col.clamp(max=block_table.shape[1] - 1)].long()
    kept = ((pos + 1) % ratio == 0) & (pos >= write_floor[slot])     # below the floor: a shared block's entry
    return torch.where(kept, block, scratch), j % per_block


def _entry_index(pos, slot, rows, block_table, ctx_blocks, ratio, per_block):
    pos, slot = _picked(rows, pos, slot)
    table = block_table[slot, :ctx_blocks].long()                                       # [C, ctx_blocks]
    flat = (table.unsqueeze(-1) * per_block + torch.arange(per_block, device=table.device)).flatten(1)
    j = torch.arange(flat.shape[1], device=table.device)
    visible = j.unsqueeze(0) < ((pos + 1) // ratio).unsqueeze(1)
    return torch.where(visible, flat, -1)
