"""CUDA graphs of the paged decode step, one per (padded batch size, context blocks).

Batch sizes are padded up a ladder (1, 2, 4, ... up to max_graph_batch); padding rows use scratch slot 0, so
they compute garbage that no sequence reads. Context blocks are rounded up to a power of two by the runner.
Graphs are captured on first use (warm-up and capture with every row on scratch, so real state is never
touched) and share one memory pool; batches above the ladder run eagerly."""

from __future__ import annotations

import torch

from deepinfer.kernels.registry import active


def ladder(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, step, model, pools, max_batch: int):
        self.step, self.model, self.pools = step, model, pools
        self.sizes = ladder(max_batch)
        dev = model.device
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def run(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, ctx_blocks: int):
        """Replays (capturing first if needed) the step for these rows; None when the batch is above the ladder."""
        b = slots.shape[0]
        size = next((s for s in self.sizes if s >= b), None)
        if size is None:
            return None
        with torch.cuda.device(self.model.device):     # capture streams are per device: the model's, not cuda:0
            return self._replay(b, size, slots, positions, tokens, ctx_blocks)

    def _replay(self, b: int, size: int, slots, positions, tokens, ctx_blocks: int) -> torch.Tensor:
        key = (size, ctx_blocks, active().name)    # a graph holds the kernels of the mode it was captured in
        if key not in self.graphs:
            self.graphs[key] = self._capture(size, ctx_blocks)
        graph, out = self.graphs[key]
        for buf, val in ((self.slots, slots), (self.positions, positions), (self.tokens, tokens)):
            buf[:b].copy_(val)
            buf[b:size].zero_()
        graph.replay()
        return out[:b]

    def _capture(self, size: int, ctx_blocks: int):
        for buf in (self.slots, self.positions, self.tokens):
            buf.zero_()
        args = (self.model, self.pools, self.slots[:size], self.positions[:size], self.tokens[:size], ctx_blocks)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self.step(*args)
        return graph, out
