"""Mixture of experts: sqrt-softplus scores, noaux_tc bias for selection only, hash routing, SwiGLU clamp."""

from __future__ import annotations

import torch
from deepinfer.kernels.precision import upcast
import torch.nn.functional as F
from torch import nn

from ..config.deepseek_v4 import HASH_MOE, DeepseekV4Config
from .layers import Linear, fp32_param

SCORE_FUNCS = {
    "sqrtsoftplus": lambda z: F.softplus(z).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda z: z.softmax(dim=-1),
}


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, is_hash: bool, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.scale, self.is_hash = cfg.num_experts_per_tok, cfg.routed_scaling_factor, is_hash
        self.score_fn = SCORE_FUNCS[cfg.scoring_func]
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype),
                                   requires_grad=False)
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.bias = fp32_param(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k] fp32, expert ids [N, k])."""
        scores = self.score_fn(F.linear(upcast(x), upcast(self.weight)))        # [N, E]
        if self.is_hash:
            ids = self.tid2eid[input_ids]
        else:
            ids = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, ids


class Experts(nn.Module):
    """All routed experts stacked: w1, w3 [E, I, D] and w2 [E, D, I] (checkpoint `experts.{j}.w*`)."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.empty(n_experts, inter, dim, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.empty(n_experts, inter, dim, dtype=dtype), requires_grad=False)
        self.quantized: dict = {}   # "w1"|"w2"|"w3" -> list of per-expert QuantizedWeight

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = upcast(torch.zeros_like(x))
        x = x.to(self.w1.dtype)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            h = swiglu(x[token] @ self.w1[e].T, x[token] @ self.w3[e].T, self.limit)
            h = h * weights[token, slot].unsqueeze(-1).to(h.dtype)   # routing weight before w2, as the reference
            out.index_add_(0, token, upcast(h @ self.w2[e].T))
        return out.to(x.dtype)


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = Linear(dim, inter, dtype), Linear(inter, dim, dtype), Linear(dim, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, mlp_type: str, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(cfg, mlp_type == HASH_MOE, dtype)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                               cfg.swiglu_limit, dtype)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           cfg.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return self.experts(x, weights, ids) + self.shared_experts(x)
