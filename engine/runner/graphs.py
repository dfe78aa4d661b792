"""CUDA graphs of steps whose rows are all sampled: uniform steps (G segments of q rows; decode: q = 1, a fixed
verify length: q = drafts + 1) and variable-length verify steps (G segments of any lengths, N rows in all).

One graph per (padded segment count, q or padded row count, context blocks, kernel table, whether draft rings
are kept). Segment counts are padded up a ladder (1, 2, 4, ... up to max_graph_batch); padding segments use
scratch slot 0, so they compute garbage that no sequence reads. A variable-length step's row count is padded up
a ladder of its own (1, 2, 3, 4, 6, 8, 12, ...: at most 1.5x), the padding rows forming one more segment on
scratch slot 0; its segment lengths are a device tensor the graph reads (ForwardBatch.varlen); the ladder stops
at max_rows (a step of 530 rows under max_rows = 576 pads to 576, not 768). Context blocks
are rounded up to a power of two by the runner. Graphs are captured on first use (warm-up and capture with every
segment on scratch, so real state is never touched) and share one memory pool; larger steps run eagerly."""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels.table import active


def ladder(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


@functools.lru_cache(maxsize=4096)
def row_ladder(rows: int) -> int:
    """The padded row count of a variable-length step: the smallest of 1, 2, 3, 4, 6, 8, 12, ... >= rows."""
    b = 1
    while True:
        for size in (b, b + b // 2):
            if size >= rows:
                return size
        b *= 2


def capture(fn, mempool) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of fn() (its static inputs are buffers fn reads) in the shared pool, and what fn returned as
    captured (the static outputs each replay rewrites): two warm-up calls on a side stream first (lazy
    allocations and autotuning happen outside the capture). Step graphs and draft-block graphs are captured here."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=mempool):
        out = fn()
    return graph, out


class _Graph:
    """One captured step and its static inputs: seg_slots, seg_starts, seg_lens [G (+1 padding segment when
    variable-length)], tokens [rows]; logits [rows, V]."""

    def __init__(self, step, device, g: int, q: int | None, rows: int, ctx_blocks: int, mempool, draft_rings: bool):
        self.q, self.g, self.rows = q, g, rows
        segs = g if q is not None else g + 1
        self.seg_slots = torch.zeros(segs, dtype=torch.long, device=device)
        self.seg_starts = torch.zeros(segs, dtype=torch.long, device=device)
        self.seg_lens = torch.zeros(segs, dtype=torch.long, device=device)
        self.seg_lens[-1] = rows                         # warm-up and capture: every row on the padding segment
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.graph, self.logits = capture(lambda: step(self.seg_slots, self.seg_starts, self.seg_lens, q, rows,
                                                       ctx_blocks, draft_rings, self.tokens), mempool)

    def replay(self, slots: list[int], starts: list[int], lens: list[int], tokens: torch.Tensor) -> torch.Tensor:
        g, n = len(slots), tokens.shape[0]
        host = torch.zeros(3, self.seg_slots.shape[0], dtype=torch.long)
        host[0, :g], host[1, :g], host[2, :g] = torch.tensor(slots), torch.tensor(starts), torch.tensor(lens)
        if self.q is None:
            host[2, -1] = self.rows - n                  # the padding rows: one segment on scratch slot 0
        self.seg_slots.copy_(host[0], non_blocking=True)
        self.seg_starts.copy_(host[1], non_blocking=True)
        self.seg_lens.copy_(host[2], non_blocking=True)
        self.tokens.zero_()
        self.tokens[:n].copy_(tokens)
        self.graph.replay()
        return self.logits[:n]


class StepGraphs:
    def __init__(self, step, device, max_batch: int, max_rows: int | None = None):
        """step: what a graph captures, ModelRunner.static_logits; max_rows: the most rows a variable-length graph
        takes (default max_batch: decode rows only)."""
        self.step, self.device = step, device
        self.sizes = ladder(max_batch)
        self.max_rows = max_rows or max_batch
        self.graphs: dict[tuple, _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self.last_rows = 0                 # rows the last replayed step ran (its graph's, padding included)

    def clear(self) -> None:
        """Forget every graph, and their memory pool with them: once its last graph is gone the allocator releases
        a private pool, and capturing into a released pool's handle fails (an allocator assert), so later
        captures take a fresh one."""
        self.graphs.clear()
        self.mempool = torch.cuda.graph_pool_handle()

    def varlen_rows(self, segments: int, rows: int) -> int | None:
        """The rows a variable-length step of `segments` segments and `rows` rows runs as (its graph's padded row
        count: the row ladder, capped at max_rows), or None when it runs eagerly (above the ladders)."""
        if segments > self.sizes[-1] or rows > self.max_rows:
            return None
        return min(row_ladder(rows), self.max_rows)

    def padded_rows(self, segments: int, rows: int) -> int:
        """What a variable-length verify step of that shape costs in rows: its graph's row count, or `rows` when
        it runs eagerly (speculative/policy.py fills the padding with drafts; the step-rate profile measures these)."""
        return self.varlen_rows(segments, rows) or rows

    def run(self, inputs, ctx_blocks: int, draft_rings: bool = False) -> torch.Tensor | None:
        """Logits [N, V] of a step whose rows are all sampled (replayed, capturing first if needed): a uniform one,
        or a variable-length one; None when it is above the ladders."""
        g, q, n = len(inputs.slots), inputs.uniform_q, inputs.tokens.shape[0]
        size = next((s for s in self.sizes if s >= g), None)
        rows = self.varlen_rows(g, n) if q is None else None if size is None else size * q
        if rows is None:
            return None
        self.last_rows = rows
        key = (size, q, rows, ctx_blocks, active().name, draft_rings)   # a graph holds the kernels it was captured with
        with torch.cuda.device(self.device):           # capture streams are per device: the model's, not cuda:0
            if key not in self.graphs:
                self.graphs[key] = _Graph(self.step, self.device, size, q, rows, ctx_blocks, self.mempool,
                                          draft_rings)
            return self.graphs[key].replay(inputs.slots, inputs.starts, inputs.lens, inputs.tokens)
