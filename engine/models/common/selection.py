"""Which compressed entries a query keeps: shared by the V4 and V4.1 indexers."""

from __future__ import annotations

import torch

from deepinfer.kernels.indexer import top_k_indices


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[T, n] scores -> [T, n] bool keeping the k best finite entries per row, through the `top_k_indices` op (the
    reference's stable sort, or the Triton radix select with the same choice).
    NOTE: FP4 q and k make exact score ties common; ties go to the lower index, so chunked prefill, decode and the
    one-shot forward select the same set."""
    t, n = scores.shape
    keep = torch.zeros((t, n + 1), dtype=torch.bool, device=scores.device)     # column n: where -1 (none) lands
    if n == 0 or k <= 0:
        return keep[:, :n]
    top = top_k_indices(scores, k)                                              # [T, min(k, n)], -1: none
    keep.scatter_(1, torch.where(top >= 0, top, n), True)
    return keep[:, :n]
