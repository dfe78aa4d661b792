"""Lightning-indexer scores, sum_h w_h * scale * ReLU(q_h . k), and the top-k of them.

  index_scores         queries against one key list shared by all of them (one sequence: the reference path)
  sparse_index_scores  each query row against its own candidate keys, given as an index list into a key store
                       (the forward over the state pools)
  top_k_indices        the k best finite scores per row, ties to the lower position (a stable sort), so every
                       path that lists candidates in entry order selects the same set"""

from __future__ import annotations

import torch

from .precision import upcast
from .registry import call
from .tiles import row_tiles

SCORE_BLOCK_ELEMENTS = 1 << 26      # gathered key elements per row block of sparse_index_scores


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """q [..., h, dI], weights [..., h], keys [..., n, dI] (leading dims broadcast) -> [..., n] >= fp32."""
    return call("index_scores")(q, weights, keys, scale)


def sparse_index_scores(q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, index: torch.Tensor,
                        scale: float = 1.0) -> torch.Tensor:
    """q [N, h, dI], weights [N, h]; store [M, dI]; index [N, K] rows of the store (-1: no candidate)
    -> scores [N, K] >= fp32, -inf where index is -1."""
    return call("sparse_index_scores")(q, weights, store, index, scale)


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [N, K] -> [N, min(k, K)] int64 positions of the k best finite scores (best first, ties to the
    lower position); -1 where a row has fewer than k finite scores."""
    return call("top_k_indices")(scores, k)


def _score_math(q, weights, keys, scale):
    s = torch.einsum("...hd,...nd->...hn", upcast(q), upcast(keys)).relu()
    if scale != 1.0:
        s = s * scale
    return (s * weights.unsqueeze(-1)).sum(dim=-2)


def _index_scores(q, weights, keys, scale):
    return _score_math(q, weights, keys, scale)


def _sparse_rows(q, weights, store, index, scale):
    keys = store[index.clamp(min=0)]                                     # [n, K, dI]
    return _score_math(q, weights, keys, scale).masked_fill(index < 0, float("-inf"))


def _sparse_index_scores(q, weights, store, index, scale):
    n, k = index.shape
    rows = max(1, SCORE_BLOCK_ELEMENTS // max(k * max(store.shape[-1], q.shape[1]), 1))
    if n <= rows:
        return _sparse_rows(q, weights, store, index, scale)
    return torch.cat([_sparse_rows(q[a:a + rows], weights[a:a + rows], store, index[a:a + rows], scale)
                      for a in range(0, n, rows)])


def _sparse_index_scores_tiles(q, weights, store, index, scale):
    return row_tiles(lambda q, w, i: _sparse_rows(q, w, store, i, scale), q, weights, index)


def _top_k_indices(scores, k):
    k = min(k, scores.shape[-1])
    order = scores.sort(dim=-1, descending=True, stable=True)
    top, vals = order.indices[:, :k], order.values[:, :k]
    return torch.where(vals > float("-inf"), top, -1)
