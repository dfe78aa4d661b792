"""Mixture of experts: route -> dispatch -> experts -> combine, plus the shared expert.

route     Gate (here): sqrt-softplus scores, noaux_tc bias for selection only, hash routing (tid2eid), V4.1 bias_vl
dispatch  MoE.dispatch (engine/parallel/dispatch.py): rows grouped by expert, static shapes, no host sync
experts   kernels.experts.grouped_experts: SwiGLU (clamped) per expert, routing weight before w2; how it computes
          is the active backend's choice from the shapes it is given
combine   MoE.dispatch.combine: each row's k outputs summed in ascending expert id, in >= fp32
Nothing here reads a device tensor on the host, so the forward can be captured in a CUDA graph."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.experts import FP4_BLOCK, ExpertWeights, grouped_experts, swiglu
from deepinfer.kernels.routing import SCORE_FUNCS, route

from ...config.deepseek_v4 import HASH_MOE, DeepseekV4Config
from ...errors import DeepInferError
from ...parallel.dispatch import Dispatched, LocalDispatch
from .layers import Linear, fp32_param

__all__ = ["FP4_BLOCK", "SCORE_FUNCS", "Experts", "Gate", "MoE", "SharedExpert", "moe_layers", "set_expert_act_quant", "set_expert_layout",
           "set_expert_numerics", "expert_layout", "swiglu",
           "expert_parallel_layers", "use_expert_parallel"]

class Gate(nn.Module):
    """Router over `n_experts`: scores = SCORE_FUNCS[score_func](x W^T / temp); `bias` steers selection only.
    Hash layers (V4) pick experts from `tid2eid[token]` instead. `bias_vl` (V4.1) is the selection
    bias for image-span tokens; text-only runs load it and leave it unused."""

    def __init__(self, dim: int, n_experts: int, top_k: int, scoring_func: str, route_scale: float,
                 dtype: torch.dtype, temp: float = 1.0, hash_vocab: int | None = None, bias_vl: bool = False,
                 normalize: bool = True):
        super().__init__()
        self.top_k, self.scale, self.temp, self.is_hash = top_k, route_scale, temp, hash_vocab is not None
        self.normalize = normalize and top_k > 1   # norm_topk_prob, as transformers applies it
        self.n_experts = n_experts
        if scoring_func not in SCORE_FUNCS:
            raise ValueError(f"scoring_func {scoring_func!r}: use one of {sorted(SCORE_FUNCS)}")
        self.score_func = scoring_func
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=dtype), requires_grad=False)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, top_k, dtype=torch.long))
        else:
            self.bias = fp32_param(n_experts)
        if bias_vl:
            self.bias_vl = fp32_param(n_experts)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [N, D] -> (weights [N, k] fp32, expert ids [N, k])."""
        return self._route(x, input_ids)

    def selection_scores(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, E] fp32 scores before the selection bias (what the bias is fitted against)."""
        logits = x.float() @ self.weight.float().t()
        return SCORE_FUNCS[self.score_func](logits if self.temp == 1.0 else logits / self.temp)

    def _route(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # kernels.routing.route (its invariant backend runs on fixed row tiles)
        return route(x, self.weight, None if self.is_hash else self.bias, top_k=self.top_k,
                     score_func=self.score_func, route_scale=self.scale, temp=self.temp, normalize=self.normalize,
                     tid2eid=self.tid2eid if self.is_hash else None, input_ids=input_ids if self.is_hash else None)


class Experts(nn.Module):
    """All routed experts stacked: w1, w3 [E, I, D] and w2 [E, D, I] (checkpoint `experts.{j}.w*`).

    storage="fp4" keeps them as the checkpoint stores them instead (e2m1 packed `w*_fp4` uint8
    [E, out, in/2] + e8m0 `w*_scale` uint8 [E, out, in/32]); the expert op dequantizes only the experts it
    computes: 0.56 bytes per weight, which is what fits a released-size layer stack on one GPU.
    The compute is kernels.experts.grouped_experts over rows a dispatcher grouped by expert."""

    SHAPES = {"w1": ("inter", "dim"), "w2": ("dim", "inter"), "w3": ("inter", "dim")}

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype,
                 storage: str = "dense"):
        super().__init__()
        self.limit, self.dtype, self.storage, self.n_experts = limit, dtype, storage, n_experts
        size = {"dim": dim, "inter": inter}
        for name, (rows, cols) in self.SHAPES.items():
            r, c = size[rows], size[cols]
            if storage == "fp4":
                self.register_buffer(f"{name}_fp4", torch.empty(n_experts, r, c // 2, dtype=torch.uint8))
                self.register_buffer(f"{name}_scale", torch.empty(n_experts, r, c // FP4_BLOCK, dtype=torch.uint8))
            else:
                setattr(self, name, nn.Parameter(torch.empty(n_experts, r, c, dtype=dtype), requires_grad=False))
        self.quantized: dict = {}   # "w1"|"w2"|"w3" -> list of per-expert QuantizedWeight
        self.act_fp8 = False        # W4A8 / W8A8: GEMM activations FP8 per 1x128 (LLM(expert_act_quant=True))
        self.layout = "rows"        # how the FP4 bytes sit in their buffers (kernels/experts.py ExpertWeights)

    def stacked(self) -> ExpertWeights:
        """The op's view of these weights (no copy)."""
        if self.storage == "fp4":
            return ExpertWeights(self.w1_fp4, self.w2_fp4, self.w3_fp4, self.dtype, self.limit,
                                 scales=(self.w1_scale, self.w2_scale, self.w3_scale), act_fp8=self.act_fp8,
                                 layout=self.layout)
        return ExpertWeights(self.w1, self.w2, self.w3, self.dtype, self.limit)

    def _join_gate_up(self) -> None:
        """w1 and w3 (bytes and scales) as the two halves of one [E, 2I, ...] buffer each, so one GEMM of 2I columns
        reads both (kernels/experts_ogs_triton.py); a layer at a time, so the old pair is freed before the next."""
        from deepinfer.kernels.experts_ogs import halves, join
        for kind in ("fp4", "scale"):
            w1, w3 = getattr(self, f"w1_{kind}"), getattr(self, f"w3_{kind}")
            if not halves(w1, w3):
                w1, w3 = join(w1, w3)
                setattr(self, f"w1_{kind}", w1)
                setattr(self, f"w3_{kind}", w3)

    def relayout(self, layout: str) -> None:
        """Hold the FP4 bytes in `layout` (kernels/experts.py weight_layout), rearranged in place (no second copy
        of the stack; for the Hopper layout W1 and W3 are first joined into one buffer, the old pair freed);
        weights that cannot take the Hopper layout (W4A8, unaligned widths) go back to or stay in rows. Dense
        stacks have one layout."""
        if self.storage != "fp4" or layout == self.layout == "rows":
            return
        from deepinfer.kernels import experts_ogs as ogs
        if layout == ogs.HOPPER and not ogs.fits(self.stacked()):
            layout = ogs.ROWS
        if layout == self.layout:
            return
        if layout == ogs.HOPPER:
            self._join_gate_up()
        convert = ogs.to_hopper if layout == ogs.HOPPER else ogs.to_rows
        for name in self.SHAPES:
            convert(getattr(self, f"{name}_fp4"), getattr(self, f"{name}_scale"))
        self.layout = layout

    def stack(self) -> dict[str, torch.Tensor]:
        """The stacked tensors by attribute name, one slice per held expert along dim 0 (weights, FP4 scales)."""
        return {n: t for n, t in [*self.named_parameters(recurse=False), *self.named_buffers(recurse=False)]
                if t.dim() and t.shape[0] == self.n_experts}

    def slot_tensors(self) -> list[torch.Tensor]:
        return list(self.stack().values())

    def hold(self, stack: dict[str, torch.Tensor]) -> None:
        """Hold these stacked tensors (a stack() of this module, or slices of one) as the experts."""
        for name, t in stack.items():
            setattr(self, name, t if isinstance(t, nn.Parameter) or name in self._buffers
                    else nn.Parameter(t, requires_grad=False))
        self.n_experts = next(iter(stack.values())).shape[0]

    def keep(self, experts: list[int]) -> None:
        """Hold these experts only, in this order (expert parallelism: the others live on other ranks; an EPLB
        placement may list an expert twice, a replica)."""
        if self.quantized:
            raise ValueError("quantized expert weights cannot be split over ranks yet")
        index = torch.tensor(experts, dtype=torch.long)
        self.hold({name: t.data.index_select(0, index.to(t.device)) for name, t in self.stack().items()})

    def compute(self, d: Dispatched) -> torch.Tensor:
        """The dispatched rows through their experts -> [N*k, D] >= fp32, in sorted order."""
        return grouped_experts(d.x, d.expert_ids, d.offsets, d.weights, self.stacked())


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
        self.dispatch = LocalDispatch(gate.n_experts)   # the engine swaps this for expert parallelism

    @classmethod
    def for_v4(cls, cfg: DeepseekV4Config, mlp_type: str, dtype: torch.dtype) -> "MoE":
        gate = Gate(cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.scoring_func,
                    cfg.routed_scaling_factor, dtype, hash_vocab=cfg.vocab_size if mlp_type == HASH_MOE else None,
                    normalize=cfg.norm_topk_prob)
        return cls(gate, cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.swiglu_limit, dtype)

    def use_expert_parallel(self, dispatcher) -> None:
        """Expert parallelism: hold the routed experts of `dispatcher.held_experts()` and let it move the rows
        (engine/parallel/expert_parallel.py). The router and the shared expert stay whole on every rank."""
        self.experts.keep(dispatcher.held_experts())
        dispatcher.slot_tensors = self.experts.slot_tensors       # EPLB moves experts between ranks through these
        self.dispatch = dispatcher

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, D] (input_ids [N] for hash layers) -> [N, D] in x's dtype."""
        weights, ids = self.gate(x, input_ids)                              # route
        d = self.dispatch.dispatch(x.to(self.experts.dtype), weights, ids)  # dispatch
        routed = self.experts.compute(d)                                    # experts
        return self.dispatch.combine(routed, d, self.shared_experts(x), x.dtype)   # combine (>= fp32) + shared


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """Every MoE of `model` (draft layers included), by module name."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def expert_layout(model: nn.Module) -> str | None:
    """How `model`'s FP4 routed experts hold their bytes (Experts.layout; comma-joined if stacks differ), None
    without FP4 experts: which kernel reads them, for result rows and the prefix cache's salt."""
    layouts = sorted({m.layout for m in model.modules() if isinstance(m, Experts) and m.storage == "fp4"})
    return ",".join(layouts) or None


def set_expert_numerics(model: nn.Module, act_quant: bool, layout: str) -> None:
    """An engine's choices for `model`'s routed experts, made at build (a passed-in model is reused, so both are
    set either way): W4A8 on or off (set_expert_act_quant), then the FP4 layout its kernel set reads
    (set_expert_layout; W4A8 keeps rows)."""
    set_expert_act_quant(model, act_quant)
    set_expert_layout(model, layout)


def set_expert_layout(model: nn.Module, layout: str) -> None:
    """Every FP4 routed-expert stack of `model` in `layout` where its weights can take it (Experts.relayout)."""
    for m in model.modules():
        if isinstance(m, Experts):
            m.relayout(layout)


def set_expert_act_quant(model: nn.Module, on: bool) -> None:
    """on: every routed-expert stack of `model` computes W4A8, its GEMM activations quantized per 1x128 to FP8
    (DeepSeek's inference recipe) instead of entering the MMA in the compute dtype (FP4 experts only); off: A16."""
    stacks = [m for m in model.modules() if isinstance(m, Experts)]
    if not on:
        for m in stacks:
            m.act_fp8 = False
        return
    if not stacks or any(m.storage != "fp4" for m in stacks):
        raise DeepInferError("expert_act_quant=True quantizes the activations of FP4 expert GEMMs (W4A8); this model's "
                             "experts are dense: build it with expert_storage='fp4' or drop expert_act_quant")
    for m in stacks:
        m.act_fp8 = True
        try:
            m.stacked()                        # the op's own check of the widths (1x128 blocks)
        except ValueError as e:
            for m2 in stacks:
                m2.act_fp8 = False
            raise DeepInferError(f"expert_act_quant=True: {e}") from None


def expert_parallel_layers(model: nn.Module, keep_whole: tuple[str, ...] = ()) -> list[tuple[str, MoE]]:
    """The MoE layers expert parallelism splits: all but those under the submodules `keep_whole` names (the draft
    layers, which keep all their experts and dispatch locally: docs/parallel.md)."""
    return [(name, moe) for name, moe in moe_layers(model)
            if not any(name == m or name.startswith(f"{m}.") for m in keep_whole)]


def use_expert_parallel(model: nn.Module, make_dispatcher, keep_whole: tuple[str, ...] = ()) -> None:
    """Every MoE of expert_parallel_layers(model, keep_whole) keeps the routed experts of this rank and moves its
    rows with make_dispatcher(module name, n_experts) (engine/parallel/expert_parallel.py)."""
    for name, moe in expert_parallel_layers(model, keep_whole):
        dispatcher = make_dispatcher(name, moe.gate.n_experts)
        dispatcher.name = name
        moe.use_expert_parallel(dispatcher)
