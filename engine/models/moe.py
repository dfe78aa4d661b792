"""Mixture of experts: sqrt-softplus scores, noaux_tc bias for selection only, hash routing, SwiGLU clamp."""

from __future__ import annotations

import contextlib
import threading

import torch
from deepinfer.kernels.matmul import linear
from deepinfer.kernels.registry import active
from deepinfer.kernels.rowwise import rowwise
from deepinfer.kernels.precision import upcast
import torch.nn.functional as F
from torch import nn

from ..config.deepseek_v4 import HASH_MOE, DeepseekV4Config
from deepinfer.kernels.quant import dequantize_fp4

from .layers import Linear, fp32_param

FP4_BLOCK = 32   # routed experts on disk: e2m1, one e8m0 scale per 32 along K

SCORE_FUNCS = {
    "sqrtsoftplus": lambda z: F.softplus(z).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda z: z.softmax(dim=-1),
}


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """In >= fp32 (the references upcast both branches), returned in >= fp32. limit <= 0: no clamp."""
    gate, up = upcast(gate), upcast(up)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


class Gate(nn.Module):
    """Router over `n_experts`: scores = score_fn(x W^T / temp); `bias` steers selection only.
    Hash layers (V4) pick experts from `tid2eid[token]` instead. `bias_vl` (V4.1) is the selection
    bias for image-span tokens; text-only runs load it and leave it unused."""

    def __init__(self, dim: int, n_experts: int, top_k: int, scoring_func: str, route_scale: float,
                 dtype: torch.dtype, temp: float = 1.0, hash_vocab: int | None = None, bias_vl: bool = False,
                 normalize: bool = True):
        super().__init__()
        self.top_k, self.scale, self.temp, self.is_hash = top_k, route_scale, temp, hash_vocab is not None
        self.normalize = normalize and top_k > 1   # norm_topk_prob, as transformers applies it
        self.n_experts = n_experts
        self.score_fn = SCORE_FUNCS[scoring_func]
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=dtype), requires_grad=False)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, top_k, dtype=torch.long))
        else:
            self.bias = fp32_param(n_experts)
        if bias_vl:
            self.bias_vl = fp32_param(n_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k] fp32, expert ids [N, k])."""
        return rowwise(self._route, x, input_ids)   # row-local (invariant: fixed tiles, CPU vector tails too)

    def _route(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(upcast(x), upcast(self.weight))
        scores = self.score_fn(logits if self.temp == 1.0 else logits / self.temp)   # [N, E]
        if self.is_hash:
            ids = self.tid2eid[input_ids]
        else:
            ids = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


GATHER_FRACTION = 4   # all-experts routing gathers the routed experts instead when rows * k * 4 <= experts


class _Routing(threading.local):
    all_experts = False


_ROUTING = _Routing()


@contextlib.contextmanager
def all_experts_routing():
    """Inside: Experts run every expert on every row (Experts.forward_all), as graph-captured decode needs."""
    before, _ROUTING.all_experts = _ROUTING.all_experts, True
    try:
        yield
    finally:
        _ROUTING.all_experts = before


class Experts(nn.Module):
    """All routed experts stacked: w1, w3 [E, I, D] and w2 [E, D, I] (checkpoint `experts.{j}.w*`).

    storage="fp4" keeps them as the checkpoint stores them instead (e2m1 packed `w*_fp4` uint8
    [E, out, in/2] + e8m0 `w*_scale` uint8 [E, out, in/32]) and dequantizes each expert when it
    runs: 0.56 bytes per weight, which is what fits a released-size layer stack on one GPU."""

    SHAPES = {"w1": ("inter", "dim"), "w2": ("dim", "inter"), "w3": ("inter", "dim")}

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype,
                 storage: str = "dense"):
        super().__init__()
        self.limit, self.dtype, self.storage = limit, dtype, storage
        size = {"dim": dim, "inter": inter}
        for name, (rows, cols) in self.SHAPES.items():
            r, c = size[rows], size[cols]
            if storage == "fp4":
                self.register_buffer(f"{name}_fp4", torch.empty(n_experts, r, c // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scale", torch.empty(n_experts, r, c // FP4_BLOCK, dtype=torch.uint8))
            else:
                setattr(self, name, nn.Parameter(torch.empty(n_experts, r, c, dtype=dtype), requires_grad=False))
        self.quantized: dict = {}   # "w1"|"w2"|"w3" -> list of per-expert QuantizedWeight

    def weight(self, name: str, e: int | torch.Tensor) -> torch.Tensor:
        """Expert e's weight (e a tensor of ids: stacked [len(e), rows, cols]) in the compute dtype."""
        if self.storage == "fp4":
            return dequantize_fp4(getattr(self, f"{name}_fp4")[e], getattr(self, f"{name}_scale")[e], FP4_BLOCK,
                                  self.dtype)
        return getattr(self, name)[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if _ROUTING.all_experts:
            return self.forward_all(x, weights, ids)
        out = upcast(torch.zeros_like(x))
        x = x.to(self.dtype)
        for e in ids.unique().tolist():          # ascending ids: each row adds its experts in expert-id order
            token, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self._expert(e, x[token], weights[token, slot]))
        return out   # >= fp32: the MoE adds the shared expert before the one cast back

    def _expert(self, e: int, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Rows x [M, D] through expert e, scaled by their routing weights w [M] before w2 (as the reference)
        -> [M, D] >= fp32. Batch-invariant mode: in fixed row tiles, so M (the rows routed to e) cannot matter."""
        w1, w2, w3 = self.weight("w1", e), self.weight("w2", e), self.weight("w3", e)

        def mlp(x, w):
            h = swiglu(linear(x, w1), linear(x, w3), self.limit)
            h = h * w.unsqueeze(-1).to(h.dtype)
            return upcast(linear(h.to(self.dtype), w2))
        return rowwise(mlp, x, w)

    def forward_all(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every row, unrouted rows weighted 0: static shapes and no host sync (CUDA graphs),
        and each row's expert sum in expert-id order whatever the batch. x [N, D] -> [N, D] >= fp32.
        At decode batch sizes nearly every expert is routed anyway, so it reads the same weights."""
        n_experts = self.w1.shape[0] if self.storage != "fp4" else self.w1_fp4.shape[0]
        dense = torch.zeros(x.shape[0], n_experts, dtype=weights.dtype, device=x.device)
        dense = dense.scatter(1, ids, weights)                                      # [N, E]
        x = x.to(self.dtype)
        out = upcast(torch.zeros_like(x))
        if active().name == "invariant":   # INTERIM (moe rework): per expert in fixed row tiles: bit for bit what forward gives
            for e in range(n_experts):
                out += self._expert(e, x, dense[:, e])
            return out
        if x.shape[0] * ids.shape[1] * GATHER_FRACTION <= n_experts:
            return self._forward_gathered(x, weights, ids)
        if self.storage == "fp4":
            for e in range(n_experts):
                h = swiglu(x @ self.weight("w1", e).T, x @ self.weight("w3", e).T, self.limit)
                out += upcast((h * dense[:, e:e + 1].to(h.dtype)).to(self.dtype) @ self.weight("w2", e).T)
            return out
        h = swiglu(torch.matmul(x, self.w1.transpose(1, 2)), torch.matmul(x, self.w3.transpose(1, 2)), self.limit)
        h = h * dense.T.unsqueeze(-1).to(h.dtype)                                  # [E, N, I]
        y = upcast(torch.matmul(h.to(self.dtype), self.w2.transpose(1, 2)))       # [E, N, D]
        for e in range(n_experts):                                                 # fixed order
            out += y[e]
        return out

    def _forward_gathered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Few rows (N*k well below E): each row's k experts' weights gathered ([N*k] slices, static shapes, no
        host sync) instead of reading every expert; each row still sums its experts in expert-id order.
        x [N, D] (compute dtype), weights/ids [N, k] -> [N, D] >= fp32."""
        n, k = ids.shape
        ids, perm = ids.sort(dim=1)
        weights = weights.gather(1, perm)
        flat = ids.reshape(-1)                                                     # [N*k]
        xs = x.repeat_interleave(k, dim=0).unsqueeze(1)                            # [N*k, 1, D]
        w1, w3, w2 = (self.weight(name, flat) for name in ("w1", "w3", "w2"))      # [N*k, I, D] / [N*k, D, I]
        h = swiglu(torch.bmm(xs, w1.transpose(1, 2)), torch.bmm(xs, w3.transpose(1, 2)), self.limit)
        h = h * weights.reshape(-1, 1, 1).to(h.dtype)                              # [N*k, 1, I]
        y = upcast(torch.bmm(h.to(self.dtype), w2.transpose(1, 2))).view(n, k, -1)
        out = torch.zeros_like(y[:, 0])
        for j in range(k):                                                         # ascending expert id
            out += y[:, j]
        return out


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = Linear(dim, inter, dtype), Linear(inter, dim, dtype), Linear(dim, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, gate: Gate, dim: int, inter: int, n_shared: int, limit: float, dtype: torch.dtype,
                 expert_storage: str = "dense"):
        super().__init__()
        self.gate = gate
        self.experts = Experts(gate.n_experts, dim, inter, limit, dtype, expert_storage)
        self.shared_experts = SharedExpert(dim, inter * n_shared, limit, dtype)

    @classmethod
    def for_v4(cls, cfg: DeepseekV4Config, mlp_type: str, dtype: torch.dtype) -> "MoE":
        gate = Gate(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.scoring_func,
                    cfg.routed_scaling_factor, dtype, hash_vocab=cfg.vocab_size if mlp_type == HASH_MOE else None,
                    normalize=cfg.norm_topk_prob)
        return cls(gate, cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return (self.experts(x, weights, ids) + upcast(self.shared_experts(x))).to(x.dtype)
