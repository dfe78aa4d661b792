"""What one engine step must touch, for the step bench's roofline (docs/bench.md): the model's tensors sorted by
how a step reads them, the experts its routing selects, and the bytes and FLOPs of a step of a given shape.

Bytes: every parameter and buffer of the layers the step runs (MTP / draft layers excluded), except routed
experts and lookup tables, in their stored dtype; lookup tables (token embedding, hash-routing tid2eid, engram
tables) as the rows gathered (N rows each, engram N x its hash columns); each MoE layer's distinct routed
experts x one expert's bytes (dense w1/w2/w3 or FP4 packed + scales); the state bytes the probe reports read.
Activations are not counted.
FLOPs: 2 x N x weights of every matrix (>= 2-D floating tensor) outside experts and tables, the LM head at its
logit rows; 2 x (3 x I x D) per routed (row, slot) pair; attention per row and layer 4 x H x d x keys attended
(QK^T and PV over the K=V latent: window + compressed entries selected / visible at that position) and the
indexer's 2 x index heads x index dim x entries it scores."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.errors import DeepInferError
from deepinfer.models.common.layers import Fp8Linear

from .traffic import layer_summary

EXCLUDED_PREFIXES = ("mtp.",)   # modules a target step does not run (MTP / DSpark draft layers)


@dataclass
class ExpertsInfo:
    n_experts: int
    bytes_per_expert: int        # stored bytes of one expert (all its tensors)
    params_per_expert: int       # weights of one expert (3 x I x D; FP4 packs two per byte)
    total_bytes: int
    storage: str


@dataclass
class Inventory:
    """The model's tensors, sorted by how a step reads them."""
    dense_bytes: int = 0                      # read whole every step (head included)
    matmul_params: int = 0                    # >= 2-D floating weights among them, head excluded
    head_params: int = 0
    tables: list = field(default_factory=list)   # (name, bytes per row, rows, lookups per token row)
    experts: dict = field(default_factory=dict)  # MoE module name -> ExpertsInfo

    def table_bytes(self, n_rows: int) -> int:
        return sum(min(n_rows * lookups, rows) * row_bytes for _, row_bytes, rows, lookups in self.tables)


def _is_table_module(name: str, module) -> bool:
    return name.split(".")[-1] == "embed" and hasattr(module, "weight") or type(module).__name__.endswith("Embedding")


def _is_stacked_experts(module) -> bool:
    """Routed experts stacked along dim 0: a 3-D `w1` (dense) or a `w1_fp4` (packed) tensor of its own."""
    w = getattr(module, "w1", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 3) or isinstance(getattr(module, "w1_fp4", None), torch.Tensor)


def _lookups_per_row(module, cfg) -> int:
    if type(module).__name__ == "EngramEmbedding":     # one row per hash column: (max n-gram - 1) x heads
        return max(1, (getattr(cfg, "engram_max_ngram_size", 2) - 1) * getattr(cfg, "engram_n_heads", 1))
    return 1


def _experts_info(module) -> ExpertsInfo:
    tensors = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
    e = int(getattr(module, "n_experts", 0) or next(t.shape[0] for n, t in tensors.items() if n.startswith("w")))
    stacked = {n: t for n, t in tensors.items() if t.dim() >= 1 and t.shape[0] == e}
    total = sum(t.numel() * t.element_size() for t in stacked.values())
    params = 0
    for n, t in stacked.items():
        if n.endswith("_scale"):
            continue
        params += t.numel() * (2 if n.endswith("_fp4") else 1)
    return ExpertsInfo(e, total // e, params // e, total, getattr(module, "storage", "dense"))


def inventory(model, excluded: tuple[str, ...] = EXCLUDED_PREFIXES) -> Inventory:
    """Walk the model once: dense tensors, lookup tables, stacked experts (by their MoE's module name)."""
    inv, seen = Inventory(), set()
    cfg = model.cfg
    modules = dict(model.named_modules())
    for name, module in modules.items():
        if any(f"{name}.".startswith(p) for p in excluded):
            continue
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if not tensors:
            continue
        if _is_stacked_experts(module):
            inv.experts[name.rsplit(".", 1)[0] if "." in name else ""] = _experts_info(module)
            seen.update(t.data_ptr() for _, t in tensors)
            continue
        table = _is_table_module(name, module)
        for tname, t in tensors:
            if t.data_ptr() in seen and t.numel():
                continue
            seen.add(t.data_ptr())
            nbytes = t.numel() * t.element_size()
            if (table and tname == "weight") or tname == "tid2eid":
                row_bytes = nbytes // max(t.shape[0], 1)
                inv.tables.append((f"{name}.{tname}", row_bytes, t.shape[0], _lookups_per_row(module, cfg)))
                continue
            inv.dense_bytes += nbytes
            block_scales = isinstance(module, Fp8Linear) and tname == "scale"      # read, but no MACs
            if t.dim() >= 2 and t.is_floating_point() and not block_scales:
                if name == "head":
                    inv.head_params += t.numel()
                else:
                    inv.matmul_params += t.numel()
    return inv


def attention_flops(cfg, positions: list[int], rows_per_position: int = 1) -> tuple[int, int]:
    """(attention, indexer) FLOPs of query rows at `positions` (each repeated rows_per_position times)."""
    h, d = cfg.num_attention_heads, cfg.head_dim
    ih, idim = getattr(cfg, "index_n_heads", 0), getattr(cfg, "index_head_dim", 0)
    attn = index = 0
    for lay in cfg.attention_layout():
        for p in positions:
            keys = min(lay["window"], p + 1)
            if lay["ratio"]:
                n = (p + 1) // lay["ratio"]
                keys += n if lay["topk"] is None else min(lay["topk"], n)
                if lay["indexer"]:
                    index += 2 * ih * idim * (n if lay["scored_limit"] is None else min(n, lay["scored_limit"]))
            attn += 4 * h * d * keys
    return attn * rows_per_position, index * rows_per_position


@dataclass
class Routing:
    """Per MoE layer: distinct experts routed to, and (row, slot) pairs routed."""
    touched: dict = field(default_factory=dict)    # MoE name -> distinct expert ids
    pairs: dict = field(default_factory=dict)      # MoE name -> routed (row, slot) pairs
    rows: int = 0                                  # most rows one dispatch call saw
    recorded: bool = True
    source: str | None = None                      # "dispatch" (record_routing) or "gate" (router hooks)
    layers: dict = field(default_factory=dict)     # harness/traffic.layer_summary of the calls (n_experts given)


def routing_from_calls(calls, n_experts: dict[str, int] | None = None) -> Routing:
    """calls: (MoE name, ids [N, k]) per dispatch, as record_routing collects them; one layer's calls merge.
    n_experts: experts per MoE name, for the per-layer traffic summary (touched against uniform, the load)."""
    out, sets = Routing(), {}
    out.layers = layer_summary([(name or "?", ids) for name, ids in calls], n_experts or {})
    for name, ids in calls:
        key = name or "?"
        sets.setdefault(key, set()).update(ids.reshape(-1).unique().tolist())
        out.pairs[key] = out.pairs.get(key, 0) + int(ids.numel())
        out.rows = max(out.rows, int(ids.shape[0]))
    out.touched = {k: len(v) for k, v in sets.items()}
    return out


def step_traffic(inv: Inventory, routing: Routing | None, point, state_bytes: int, cfg,
                 logit_rows: int | None = None) -> dict:
    """Bytes by kind and FLOPs by kind of one step (docs/bench.md: the formulas); point: a StepPoint (its rows,
    batch and positions)."""
    n = point.rows
    logit_rows = n if logit_rows is None else logit_rows
    expert_bytes = expert_flops = touched = 0
    for name, info in inv.experts.items():
        if routing is None or not routing.recorded:
            touched += info.n_experts                                  # unknown routing: every expert
            expert_bytes += info.total_bytes
            expert_flops += 2 * info.params_per_expert * n * _top_k(cfg)
            continue
        k = routing.touched.get(name, 0)
        touched += k
        expert_bytes += k * info.bytes_per_expert
        expert_flops += 2 * info.params_per_expert * routing.pairs.get(name, 0)
    dense_bytes = inv.dense_bytes + inv.table_bytes(n)
    attn, index = attention_flops(cfg, point.positions(), point.batch)
    dense_flops = 2 * n * inv.matmul_params + 2 * logit_rows * inv.head_params
    flops = {"dense": dense_flops, "experts": expert_flops, "attention": attn, "indexer": index}
    flops["total"] = sum(flops.values())
    nbytes = {"dense_weights": dense_bytes, "experts": expert_bytes, "state": int(state_bytes)}
    nbytes["total"] = sum(nbytes.values())
    return {"bytes": nbytes, "flops": flops, "experts_touched": touched,
            "experts_total": sum(i.n_experts for i in inv.experts.values()),
            "expert_bytes_all": sum(i.total_bytes for i in inv.experts.values())}


def _top_k(cfg) -> int:
    return int(getattr(cfg, "num_experts_per_tok", 1))



def check_storage(inv: Inventory, wanted: str) -> str:
    got = sorted({i.storage for i in inv.experts.values()}) or ["none"]
    if inv.experts and got != [wanted]:
        raise DeepInferError(f"--expert-storage {wanted}: the built model keeps its routed experts {'/'.join(got)} "
                             f"(random deepseek_v4 models are built with dense experts); use --expert-storage "
                             f"{got[0]} or a model that supports {wanted}")
    return got[0]

