"""Which compressed entries a query may see and keeps: shared by the V4 and V4.1 indexers."""

from __future__ import annotations

import torch


def visible_entries(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """[T, n] bool: entry w (pooling positions w*ratio .. w*ratio+ratio-1) is visible to the query at
    position p once its window closed, w < (p+1)//ratio."""
    entry = torch.arange(num_entries, device=positions.device)
    return entry.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, n] scores -> [T, n] bool keeping the k best finite entries per row.
    NOTE: FP4 q and k make exact score ties common; a stable sort breaks them toward the lower index, so
    chunked prefill, decode and the one-shot forward select the same set."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    if scores.shape[-1] == 0 or k <= 0:
        return keep
    top = scores.sort(dim=-1, descending=True, stable=True).indices[:, : min(k, scores.shape[-1])]
    keep.scatter_(1, top, True)
    return keep & (scores > float("-inf"))
