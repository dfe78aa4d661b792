"""MoE routing ops: `route` (router scores -> top-k experts and weights) and `permute` (the (row, slot) pairs
grouped by expert), the two steps between a MoE layer's input and its grouped expert op.

route(x [N, D], weight [E, D], bias [E] | None, ...) -> (weights [N, k], ids [N, k] int64)
    logits = x W^T in >= fp32; scores = score_fn(logits / temp) ("sqrtsoftplus" | "sigmoid" | "softmax");
    ids = top-k of scores + bias (the bias steers selection only; hash layers: ids = tid2eid[input_ids]);
    weights = the unbiased scores of those ids, normalized to sum 1 (+1e-20) if `normalize`, times route_scale.
    Scored layers list ids in descending biased score (torch.topk's order); hash layers in tid2eid's.
permute(ids [N, k], weights [N, k], n_experts, logical_to_physical) -> the M = N*k pairs grouped by expert, and
    the input row of each:
    each row's slots in ascending logical id (the combine order), then a stable grouping by physical expert
    (within an expert the pairs stay in that flat order). Integer outputs, so every backend gives the same bits.

Backends:
  reference         plain torch (the math the model used before these ops)
  invariant         route on fixed row tiles (kernels/tiles.py); permute is exact, so its reference stands in
  triton, triton_invariant   kernels/routing_triton.py: route as one fused kernel per row block (the invariant
                    set always through the chunk programs), permute as a counting sort with static shapes.

Ties in route's selection: the Triton kernel picks the lowest expert id among equal biased scores, round by
round. torch.topk on CPU returns tied values in an implementation-defined order (seen: the top 3 of
[1, 3, 3, 0, 3, 2, 2] come as [2, 4, 1]; 6 of 256 zeros as [172, 169, 170, ...]), so with exact ties the two may
list different ids; without ties they agree."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .matmul import linear
from .precision import upcast
from .registry import call
from .tiles import row_tiles

__all__ = ["SCORE_FUNCS", "permute", "route"]

SCORE_FUNCS = {
    "sqrtsoftplus": lambda z: F.softplus(z).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda z: z.softmax(dim=-1),
}


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, top_k: int, score_func: str,
          route_scale: float, temp: float = 1.0, normalize: bool = True, tid2eid: torch.Tensor | None = None,
          input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D], weight [E, D], bias [E] fp32 or None -> (weights [N, k] fp32 (float64 for float64 x),
    ids [N, k] int64). Hash routing: tid2eid [V, k] int64 and input_ids [N] give the ids (bias unused)."""
    return call("route")(x, weight, bias, top_k=top_k, score_func=score_func, route_scale=route_scale,
                         temp=temp, normalize=normalize, tid2eid=tid2eid, input_ids=input_ids)


def permute(ids: torch.Tensor, weights: torch.Tensor, n_experts: int,
            logical_to_physical: torch.Tensor | None = None):
    """ids [N, k] int64 (logical experts), weights [N, k], n_experts (physical) E ->
    (expert_ids [M] int64 ascending, offsets [E+1] int64, order [M] int64 (flat row * k + slot of each sorted
    pair, slots in ascending logical id), inverse [M] int64 (order's inverse), sorted_weights [M], rows [M] int64
    (order // k: the input row each sorted pair reads)), M = N*k.
    logical_to_physical [E_logical] int64 maps router ids to physical experts (None: identity)."""
    return call("permute")(ids, weights, n_experts, logical_to_physical)


def _route_reference(x, weight, bias, *, top_k, score_func, route_scale, temp, normalize, tid2eid=None,
                     input_ids=None):
    logits = linear(upcast(x), upcast(weight))
    scores = SCORE_FUNCS[score_func](logits if temp == 1.0 else logits / temp)   # [N, E]
    if tid2eid is not None:
        ids = tid2eid[input_ids]
    else:
        ids = (scores if bias is None else scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * route_scale, ids


def _route_tiles(x, weight, bias, *, input_ids=None, **kw):
    # row-local: fixed tiles fix the GEMM's blocking and the CPU vector tails of the score fn on [N, E]
    return row_tiles(lambda t, i: _route_reference(t, weight, bias, input_ids=i, **kw), x, input_ids)


def _permute_reference(ids, weights, n_experts, logical_to_physical=None):
    n, k = ids.shape
    ids, perm = ids.sort(dim=1, stable=True)           # each row's slots in ascending logical id: the combine order
    weights = weights.gather(1, perm).reshape(-1)
    phys = ids if logical_to_physical is None else logical_to_physical[ids]
    expert_ids, order = phys.reshape(-1).sort(stable=True)
    positions = torch.arange(n * k, device=ids.device)
    inverse = torch.empty_like(order).scatter_(0, order, positions)
    offsets = torch.searchsorted(expert_ids, torch.arange(n_experts + 1, device=ids.device))
    return expert_ids, offsets, order, inverse, weights.index_select(0, order), order // k
