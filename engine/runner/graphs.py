"""CUDA graphs of uniform steps: G segments of q rows, every row sampled (decode: q = 1; verify: q = drafts + 1).

One graph per (padded segment count, q, context blocks, kernel table, whether draft rings are kept). Segment counts are padded up a ladder
(1, 2, 4, ... up to max_graph_batch); padding segments use scratch slot 0, so they compute garbage that no
sequence reads. Context blocks are rounded up to a power of two by the runner. Graphs are captured on first use
(warm-up and capture with every segment on scratch, so real state is never touched) and share one memory pool;
larger steps run eagerly."""

from __future__ import annotations

import torch

from deepinfer.kernels.table import active

from ..cache.forward_batch import ForwardBatch


def ladder(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class _Graph:
    """One captured step and its static inputs: seg_slots, seg_starts [G], tokens [G*q]; logits [G*q, V]."""

    def __init__(self, model, pools, g: int, q: int, ctx_blocks: int, mempool, draft_rings: bool):
        dev = model.device
        self.q = q
        self.seg_slots = torch.zeros(g, dtype=torch.long, device=dev)
        self.seg_starts = torch.zeros(g, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(g * q, dtype=torch.long, device=dev)

        def step():
            fb = ForwardBatch.uniform(pools, self.seg_slots, self.seg_starts, q, ctx_blocks, draft_rings)
            return model.logits(model.forward(self.tokens, fb))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.logits = step()

    def replay(self, slots: list[int], starts: list[int], tokens: torch.Tensor) -> torch.Tensor:
        g = len(slots)
        host = torch.tensor([slots, starts], dtype=torch.long)
        self.seg_slots.zero_()
        self.seg_starts.zero_()
        self.tokens.zero_()
        self.seg_slots[:g].copy_(host[0], non_blocking=True)
        self.seg_starts[:g].copy_(host[1], non_blocking=True)
        self.tokens[:g * self.q].copy_(tokens)
        self.graph.replay()
        return self.logits[:g * self.q]


class StepGraphs:
    def __init__(self, model, pools, max_batch: int):
        self.model, self.pools = model, pools
        self.sizes = ladder(max_batch)
        self.graphs: dict[tuple[int, int, int, str], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle()

    def run(self, inputs, ctx_blocks: int, draft_rings: bool = False) -> torch.Tensor | None:
        """Logits [G*q, V] of a uniform step (replayed, capturing first if needed); None above the ladder."""
        g, q = len(inputs.slots), inputs.uniform_q
        size = next((s for s in self.sizes if s >= g), None)
        if size is None:
            return None
        key = (size, q, ctx_blocks, active().name, draft_rings)   # a graph holds the kernels it was captured with
        with torch.cuda.device(self.model.device):     # capture streams are per device: the model's, not cuda:0
            if key not in self.graphs:
                self.graphs[key] = _Graph(self.model, self.pools, size, q, ctx_blocks, self.mempool, draft_rings)
            return self.graphs[key].replay(inputs.slots, inputs.starts, inputs.tokens)
