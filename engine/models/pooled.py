"""Reading state out of the pools for attention, shared by the V4 and V4.1 layers: index lists, never copies of
whole pools (cache/forward_batch.py builds the indices)."""

from __future__ import annotations

import torch

from ..cache.forward_batch import ForwardBatch


def gather_window(batch: ForwardBatch, ring: torch.Tensor, kv: torch.Tensor, window: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sliding window of every row: latents of positions p-window+1 .. p, from the ring [S, W, d] (before
    this step) and this step's kv [N, d]. Returns one sparse-attention source (store [G*W + N, d], index
    [N, window]); then writes kv into the ring."""
    source = batch.store(ring, kv), batch.positions_index(None, window, ring.shape[1])
    batch.write_ring(ring, kv)
    return source


def selected_entries(entry_index: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """entry_index [N, J] store rows of each row's candidate entries, top [N, k] positions into J (-1: none)
    -> the selected store rows [N, k] (-1: none)."""
    return torch.where(top >= 0, entry_index.gather(1, top.clamp(min=0)), -1)
