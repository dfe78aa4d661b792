"""Driving the runtime forward (model.forward over state pools) directly, for tests: slots with their own
block-table rows, steps given as {slot: tokens}, logits compared with the reference path."""

from __future__ import annotations

import torch

from deepinfer.cache.forward_batch import ForwardBatch
from deepinfer.cache.pools import PoolLayout, StatePools


class PooledSequences:
    """`num_slots` sequences in pools of their own; slot s owns blocks (s-1)*per + 1 .. s*per."""

    def __init__(self, model, num_slots: int, max_len: int, block_tokens: int | None = None,
                 fixed_context: bool = False, ring_slack: int = 0):
        """fixed_context: every step reads all block-table columns (batch-invariant mode's fixed shapes).
        ring_slack: every ring holds that many more positions (speculation's layout)."""
        self.model, self.fixed_context = model, fixed_context
        self.layout = PoolLayout.for_model(model, block_tokens, ring_slack=ring_slack)
        per = max(self.layout.blocks_for(max_len), 1)
        self.pools = StatePools(self.layout, num_slots, num_slots * per, max_len, model.device)
        table = self.pools.block_table
        for s in range(1, num_slots + 1):
            table[s, :per] = torch.arange((s - 1) * per + 1, s * per + 1, dtype=table.dtype, device=table.device)
        self.done = {s: 0 for s in range(1, num_slots + 1)}

    def ctx_blocks(self, max_position: int) -> int:
        if self.fixed_context:
            return self.pools.max_blocks
        return min(max(self.layout.blocks_for(max_position + 1), 1), self.pools.max_blocks)

    @torch.inference_mode()
    def step(self, feeds: dict[int, torch.Tensor], uniform: bool = False, last_only: bool = False,
             draft_rings: bool = False, varlen_pad: int | None = None) -> dict[int, torch.Tensor]:
        """Feed each slot its tokens [n] in one flat batch -> {slot: logits [n, V]}. uniform: build the batch as a
        CUDA graph would (static shapes, every slot the same n). last_only: mark every segment so (only its last
        row's logits are meaningful). varlen_pad: build it as a variable-length graph would (ForwardBatch.varlen,
        lengths on the device), with that many padding rows on scratch slot 0 after the real ones."""
        slots = list(feeds)
        starts = [self.done[s] for s in slots]
        lens = [feeds[s].numel() for s in slots]
        ctx = self.ctx_blocks(max(a + n - 1 for a, n in zip(starts, lens)))
        dev = self.model.device
        if uniform:
            assert len(set(lens)) == 1
            fb = ForwardBatch.uniform(self.pools, torch.tensor(slots, device=dev), torch.tensor(starts, device=dev),
                                      lens[0], ctx)
        elif varlen_pad is not None:
            seg = torch.tensor([slots + [0], starts + [0], lens + [varlen_pad]], device=dev)
            fb = ForwardBatch.varlen(self.pools, seg[0], seg[1], seg[2], sum(lens) + varlen_pad, ctx)
        else:
            fb = ForwardBatch.ragged(self.pools, slots, starts, lens, ctx, [last_only] * len(slots),
                                     draft_rings=draft_rings)
        # every piece on the model's device: feeds may come from either side, and torch.cat refuses a mix
        ids = torch.cat([feeds[s].to(dev) for s in slots]
                        + [torch.zeros(varlen_pad or 0, dtype=torch.long, device=dev)])
        logits = self.model.logits(self.model.forward(ids, fb))
        out, o = {}, 0
        for s, n in zip(slots, lens):
            out[s] = logits[o:o + n]
            o += n
            self.done[s] += n
        return out
