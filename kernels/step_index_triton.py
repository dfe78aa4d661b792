"""Triton step-index ops (the contracts: kernels/step_index.py) for `triton` and `triton_invariant`: each op one
launch where torch takes 4-24 elementwise ones. Integer arithmetic on each row's own inputs, so one function
serves both sets and the integers equal the reference's (tests/interpreted/test_step_index_triton.py).

Static shapes, no host reads: they capture in a CUDA graph. Off CUDA (and outside the interpreter) the functions
call the torch reference.
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device, pow2
from .pdl import pdl
from .step_index import _entry_index, _entry_pick, _entry_slots, _ring_index, _ring_slots

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

BLOCK_ROWS = 16              # rows per ring_index program
BLOCK = 256                  # rows per ring_slots / entry_slots program
RING_BLOCK_COLS = 128        # ring_index columns per program: [16, 256] int64 tiles spill on sm_90 (ptxas)
ENTRY_BLOCK_COLS = 1024      # entry_index columns per program (one row a program: no spills at 1024)

if triton is not None:

    @triton.jit
    def _row_of(rows_ptr, i, ok, HAS_ROWS: tl.constexpr):
        """The step row behind output row i: rows[i], or i itself."""
        if HAS_ROWS:
            return tl.load(rows_ptr + i, mask=ok, other=0)
        return i

    @triton.jit
    def _ring_index_kernel(pos_ptr, start_ptr, first_ptr, ring_ptr, rows_ptr, out_ptr, C, count, base, span,
                           HAS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr):
        """Program (b, t): out [C, count] at rows [b * BLOCK_R, +BLOCK_R), columns [t * BLOCK_T, +BLOCK_T)."""
        await_inputs(PDL)
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        i_ok = i < C
        r = _row_of(rows_ptr, i.to(tl.int64), i_ok, HAS_ROWS)
        p = tl.load(pos_ptr + r, mask=i_ok, other=0)
        a = tl.load(start_ptr + r, mask=i_ok, other=0)
        o = tl.load(first_ptr + r, mask=i_ok, other=0)
        g = tl.load(ring_ptr + r, mask=i_ok, other=0)
        tp = p[:, None] - (count - 1) + t[None, :].to(tl.int64)                              # [BLOCK_R, BLOCK_T]
        new = base + o[:, None] + tp - a[:, None]
        old = g[:, None] * span + tp % span            # C's remainder: differs from torch's only where tp < 0
        idx = tl.where(tp >= a[:, None], new, old)
        idx = tl.where(tp >= 0, idx, -1)
        tl.store(out_ptr + i[:, None].to(tl.int64) * count + t[None, :], idx, mask=i_ok[:, None] & (t < count)[None, :])

    @triton.jit
    def _ring_slots_kernel(pos_ptr, end_ptr, slot_ptr, out_slot_ptr, out_at_ptr, N, span, scratch,
                           BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < N
        p = tl.load(pos_ptr + i, mask=ok, other=0)
        e = tl.load(end_ptr + i, mask=ok, other=0)
        s = tl.load(slot_ptr + i, mask=ok, other=0)
        tl.store(out_slot_ptr + i, tl.where(p >= e - span, s, scratch), mask=ok)
        tl.store(out_at_ptr + i, p % span, mask=ok)

    @triton.jit
    def _entry_slots_kernel(pos_ptr, slot_ptr, rows_ptr, table_ptr, floor_ptr, out_block_ptr, out_at_ptr,
                            C, stride_t, max_blocks, ratio, per_block, block_tokens, scratch,
                            HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < C
        r = _row_of(rows_ptr, i.to(tl.int64), ok, HAS_ROWS)
        p = tl.load(pos_ptr + r, mask=ok, other=0)
        s = tl.load(slot_ptr + r, mask=ok, other=0)
        j = p // ratio
        col = tl.minimum((j * ratio) // block_tokens, max_blocks - 1)
        block = tl.load(table_ptr + s * stride_t + col, mask=ok, other=0).to(tl.int64)
        kept = ((p + 1) % ratio == 0) & (p >= tl.load(floor_ptr + s, mask=ok, other=0))
        tl.store(out_block_ptr + i, tl.where(kept, block, scratch), mask=ok)
        tl.store(out_at_ptr + i, j % per_block, mask=ok)

    @triton.jit
    def _entry_index_kernel(pos_ptr, slot_ptr, rows_ptr, table_ptr, out_ptr, C, J, stride_t, ratio, per_block,
                            HAS_ROWS: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
        """Program (i, b): out [C, J] row i, columns [b * BLOCK_J, +BLOCK_J)."""
        await_inputs(PDL)
        i = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        j_ok = j < J
        r = _row_of(rows_ptr, i, True, HAS_ROWS)
        p = tl.load(pos_ptr + r)
        s = tl.load(slot_ptr + r)
        block = tl.load(table_ptr + s * stride_t + j // per_block, mask=j_ok, other=0).to(tl.int64)
        entry = block * per_block + (j % per_block)
        tl.store(out_ptr + i * J + j, tl.where(j < (p + 1) // ratio, entry, -1), mask=j_ok)

    @triton.jit
    def _entry_pick_kernel(index_ptr, top_ptr, out_ptr, C, J, k, stride_i, stride_t, BLOCK_C: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        i = tl.arange(0, BLOCK_K)
        ok = (c < C)[:, None] & (i < k)[None, :]
        top = tl.load(top_ptr + c[:, None].to(tl.int64) * stride_t + i[None, :], mask=ok, other=-1)
        picked = tl.load(index_ptr + c[:, None].to(tl.int64) * stride_i + tl.maximum(top, 0), mask=ok & (top >= 0),
                         other=-1)
        tl.store(out_ptr + c[:, None].to(tl.int64) * k + i[None, :], tl.where(top >= 0, picked, -1), mask=ok)

    INTERPRETED = is_interpreted(_ring_index_kernel)
else:
    INTERPRETED = False


def _runs(*tensors) -> bool:
    return triton is not None and on_kernel_device(INTERPRETED, *[t for t in tensors if t is not None])


def _flat(t):
    return None if t is None else t.contiguous()


def ring_index_triton(pos, start, first, ring, rows, base, count, span):
    if not _runs(pos, start, first, ring, rows):
        return _ring_index(pos, start, first, ring, rows, base, count, span)
    c = pos.shape[0] if rows is None else rows.shape[0]
    out = torch.empty((c, count), dtype=torch.long, device=pos.device)
    if c == 0 or count == 0:
        return out
    block_t = min(pow2(count), RING_BLOCK_COLS)
    pos, start, first, ring, rows = (_flat(t) for t in (pos, start, first, ring, rows))
    _ring_index_kernel[(triton.cdiv(c, BLOCK_ROWS), triton.cdiv(count, block_t))](
        pos, start, first, ring, pos if rows is None else rows, out, c, count, base, span,
        HAS_ROWS=rows is not None, BLOCK_R=BLOCK_ROWS, BLOCK_T=block_t, num_warps=4, **pdl(pos.device))
    return out


def ring_slots_triton(pos, end, slot, span, scratch):
    if not _runs(pos, end, slot):
        return _ring_slots(pos, end, slot, span, scratch)
    n = pos.shape[0]
    out_slot = torch.empty(n, dtype=torch.long, device=pos.device)
    out_at = torch.empty(n, dtype=torch.long, device=pos.device)
    if n:
        _ring_slots_kernel[(triton.cdiv(n, BLOCK),)](_flat(pos), _flat(end), _flat(slot), out_slot, out_at, n, span,
                                                    scratch, BLOCK=BLOCK, num_warps=4, **pdl(pos.device))
    return out_slot, out_at


def entry_slots_triton(pos, slot, rows, block_table, write_floor, ratio, per_block, block_tokens, scratch):
    if not _runs(pos, slot, rows, block_table, write_floor) or block_table.stride(1) != 1:
        return _entry_slots(pos, slot, rows, block_table, write_floor, ratio, per_block, block_tokens, scratch)
    c = pos.shape[0] if rows is None else rows.shape[0]
    out_block = torch.empty(c, dtype=torch.long, device=pos.device)
    out_at = torch.empty(c, dtype=torch.long, device=pos.device)
    if c:
        pos, slot, rows, floor = (_flat(t) for t in (pos, slot, rows, write_floor))
        _entry_slots_kernel[(triton.cdiv(c, BLOCK),)](
            pos, slot, pos if rows is None else rows, block_table, floor, out_block, out_at, c,
            block_table.stride(0), block_table.shape[1], ratio, per_block, block_tokens, scratch,
            HAS_ROWS=rows is not None, BLOCK=BLOCK, num_warps=4, **pdl(pos.device))
    return out_block, out_at


def entry_index_triton(pos, slot, rows, block_table, ctx_blocks, ratio, per_block):
    if not _runs(pos, slot, rows, block_table) or block_table.stride(1) != 1:
        return _entry_index(pos, slot, rows, block_table, ctx_blocks, ratio, per_block)
    c = pos.shape[0] if rows is None else rows.shape[0]
    j = min(ctx_blocks, block_table.shape[1]) * per_block            # as the reference's slice [:, :ctx_blocks]
    out = torch.empty((c, j), dtype=torch.long, device=pos.device)
    if c == 0 or j == 0:
        return out
    block_j = min(pow2(j), ENTRY_BLOCK_COLS)
    pos, slot, rows = (_flat(t) for t in (pos, slot, rows))
    _entry_index_kernel[(c, triton.cdiv(j, block_j))](
        pos, slot, pos if rows is None else rows, block_table, out, c, j, block_table.stride(0), ratio, per_block,
        HAS_ROWS=rows is not None, BLOCK_J=block_j, num_warps=4, **pdl(pos.device))
    return out


PICK_BLOCK_ELEMENTS = 4096   # entry_pick: rows x k per program


def entry_pick_triton(index, top):
    if not _runs(index, top) or index.stride(1) != 1 or top.stride(1) != 1 or index.dtype != torch.long \
            or top.dtype != torch.long:
        return _entry_pick(index, top)
    c, k = top.shape
    out = torch.empty((c, k), dtype=torch.long, device=top.device)
    if c == 0 or k == 0:
        return out
    block_k = pow2(k, 1)
    block_c = max(1, min(pow2(c, 1), PICK_BLOCK_ELEMENTS // block_k))
    _entry_pick_kernel[(triton.cdiv(c, block_c),)](index, top, out, c, index.shape[1], k, index.stride(0),
                                                  top.stride(0), BLOCK_C=block_c, BLOCK_K=block_k, num_warps=4,
                                                   **pdl(index.device))
    return out
