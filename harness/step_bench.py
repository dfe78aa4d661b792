"""`deepinfer-bench step`: one engine step measured against its roofline, one row per (model, batch, context,
backend) point (docs/bench.md).

Per run: the device ceilings once (harness/ceilings.py), one engine build, then per point a StepProbe
(engine/runner/probe.py) holding B synthetic sequences of C positions in the engine's pools, and
  routing   one eager probe.run() under deepinfer.parallel.dispatch.record_routing() (or, where the MoE does not
            go through a dispatcher, forward hooks on its router): the experts each MoE layer actually routes
            this batch to (distinct ids) and the (row, slot) pairs it routes;
  timing    `warmup` runs (graph capture included), then `iters` timed runs: CUDA events around each run() on
            a GPU (graph replay where the engine captured one), perf_counter on CPU;
  idle      a torch.profiler trace over `trace_steps` consecutive runs: 1 - (union of GPU kernel / memcpy /
            memset intervals) / (first start .. last end); None on CPU;
  roofline  bytes the step must touch (dense weights, the routed experts, state) and FLOPs it must do (below),
            over the measured ceilings; ratio = measured median / roofline.

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

import contextlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepinfer.errors import DeepInferError
from deepinfer.models.common.layers import Fp8Linear
from deepinfer.cache.pools import KV_CACHE_DTYPES
from deepinfer.validate import EXPERT_STORAGE, PROJECTION_STORAGE, check_device, check_expert_storage, check_model_spec, parse_dtype

from .ceilings import measure_ceilings, roofline
from .limits import Term, check_kernel_backend, check_positions, model_limits
from .options import check_distinct
from .traffic import TRAFFIC_HEADER, layer_summary, traffic_cell, traffic_summary
from .rows import (SCHEMA_VERSION, RowStore, atomic_write_text, done_keys, environment, read_rows,
                   refuse_existing_rows, run_dir_for, run_dir_guard, utc_now)

log = logging.getLogger("deepinfer")

STEP_METHOD_VERSION = "1"       # how step points are measured (bump when timing / accounting changes)
DEFAULT_MODEL = "random:deepseek_v4:tiny:4"
EXCLUDED_PREFIXES = ("mtp.",)   # modules a target step does not run (MTP / DSpark draft layers)
BUSY_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


# --------------------------------------------------------------------------------------------- run definition

@dataclass(frozen=True)
class StepPoint:
    shape: str            # decode (q = 1), verify (q > 1 tokens per row), prefill (one row of T tokens)
    batch: int
    context: int          # positions already in each row's state
    query_len: int        # tokens each row feeds this step

    @property
    def key(self) -> str:
        if self.shape == "prefill":
            return f"prefill-t{self.query_len}"
        return f"{self.shape}-b{self.batch}-c{self.context}-q{self.query_len}"

    @property
    def rows(self) -> int:
        """N: token rows the step computes."""
        return self.batch * self.query_len

    def positions(self) -> list[int]:
        """The position of each token of one row (every row of the batch has the same)."""
        return list(range(self.context, self.context + self.query_len))


@dataclass(frozen=True)
class StepConfig:
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "float32"
    expert_storage: str = "dense"
    kernel_backend: str | None = None
    batches: tuple[int, ...] = (1, 8)
    contexts: tuple[int, ...] = (128, 512)
    query_len: int = 1
    prefill: tuple[int, ...] = ()
    iters: int = 20
    warmup: int = 3
    trace_steps: int = 5
    graphs: bool = True
    seed: int = 0
    expert_act_quant: bool = False      # W4A8 experts (LLM(expert_act_quant=True)); FP4 storage only
    projection_storage: str = "dense"   # "fp8": the release's FP8 projections kept FP8 (fp8_linear, W8A8)
    kv_cache_dtype: str = "auto"        # "fp8": the release's FP8 / FP4 cache records (LLM(kv_cache_dtype=...))

    def __post_init__(self):
        if self.expert_act_quant and self.expert_storage != "fp4":
            raise DeepInferError("--expert-act-quant quantizes the activations of FP4 expert GEMMs (W4A8); add "
                                 "--expert-storage fp4")
        for name in ("query_len", "iters", "trace_steps"):
            if getattr(self, name) < 1:
                raise DeepInferError(f"--{name.replace('_', '-')} must be at least 1")
        if self.warmup < 0:
            raise DeepInferError("--warmup must be at least 0")
        if self.projection_storage not in PROJECTION_STORAGE:
            raise DeepInferError(f"--projection-storage {self.projection_storage!r}: use one of "
                                 f"{', '.join(PROJECTION_STORAGE)}")
        if self.expert_storage not in EXPERT_STORAGE:
            raise DeepInferError(f"--expert-storage {self.expert_storage!r}: use one of {', '.join(EXPERT_STORAGE)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise DeepInferError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: use one of {', '.join(KV_CACHE_DTYPES)}")
        parse_dtype(self.dtype)
        for option, values in (("--batch", self.batches), ("--context", self.contexts), ("--prefill", self.prefill)):
            check_distinct(option, values)
        if not self.points():
            raise DeepInferError("no points: give --batch and --context, or --prefill")

    def points(self) -> list[StepPoint]:
        shape = "decode" if self.query_len == 1 else "verify"
        pts = [StepPoint(shape, b, c, self.query_len) for c in self.contexts for b in self.batches]
        return pts + [StepPoint("prefill", 1, 0, t) for t in self.prefill]

    def identity(self) -> dict:
        """What must match for --resume (the point lists may grow: done points are skipped)."""
        return comparable(asdict(self))

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def engine_args(self) -> dict:
        """LLM arguments sized for the largest point: seats for the largest batch, positions for the longest
        row, a step budget for the largest step."""
        pts = self.points()
        seqs = max(p.batch for p in pts)
        longest = max(p.context + p.query_len for p in pts)
        tokens = max(max(p.rows for p in pts), seqs, 64)
        args = {"max_num_seqs": seqs, "max_model_len": longest, "max_num_batched_tokens": tokens,
                "enforce_eager": not self.graphs, "expert_storage": self.expert_storage}
        if self.kernel_backend is not None:
            args["kernel_backend"] = self.kernel_backend
        if self.expert_act_quant:
            args["expert_act_quant"] = True
        if self.projection_storage != "dense":
            args["projection_storage"] = self.projection_storage
        if self.kv_cache_dtype != "auto":
            args["kv_cache_dtype"] = self.kv_cache_dtype
        return args

    def check_positions(self) -> None:
        """engine_args' max_model_len (the longest point) mapped back to --context / --query-len / --prefill and
        checked against the model's positions, from its config alone (before anything is built)."""
        limits = model_limits(self.model)
        rows = [p for p in self.points() if p.shape != "prefill"]
        if rows:
            longest = max(rows, key=lambda p: p.context + p.query_len)
            check_positions(self.model, limits, [Term("--context", longest.context, minimum=0),
                                                 Term("--query-len", longest.query_len)])
        if self.prefill:
            check_positions(self.model, limits, [Term("--prefill", max(self.prefill))])


# ------------------------------------------------------------------------------------- what a step must touch

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


def step_traffic(inv: Inventory, routing: Routing | None, point: StepPoint, state_bytes: int, cfg,
                 logit_rows: int | None = None) -> dict:
    """Bytes by kind and FLOPs by kind of one step (docs/bench.md: the formulas)."""
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


# ------------------------------------------------------------------------------------------------ measuring

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(run, device: torch.device, iters: int) -> dict:
    """Per-step ms of `iters` back-to-back run() calls: CUDA events around each (graph replays queue ahead,
    so events measure device time plus any launch gaps inside a step), perf_counter on CPU."""
    if device.type == "cuda":
        _sync(device)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in pairs:
            a.record()
            run()
            b.record()
        _sync(device)
        ms = [a.elapsed_time(b) for a, b in pairs]
        span = pairs[0][0].elapsed_time(pairs[-1][1])
    else:
        ms = []
        t_start = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            ms.append(1e3 * (time.perf_counter() - t0))
        span = 1e3 * (time.perf_counter() - t_start)
    return {"step_ms_mean": statistics.fmean(ms), "step_ms_median": statistics.median(ms),
            "step_ms_p90": _percentile(ms, 0.9), "step_ms_min": min(ms), "step_ms_max": max(ms),
            "step_ms_span_mean": span / iters, "step_ms_samples": ms}


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of [start, end) intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0.0)


TOP_KERNELS = 25         # GPU activities listed per traced point (gpu_trace.top_kernels)


def idle_from_trace(events: list[dict]) -> dict | None:
    """Chrome-trace events -> GPU idle between the first kernel start and the last kernel end (None when the
    trace holds no GPU activity)."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
             if e.get("ph") == "X" and str(e.get("cat", "")).lower() in BUSY_CATEGORIES]
    if not spans:
        return None
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    busy = busy_union(spans)
    span = end - start
    return {"idle_fraction": 1.0 - busy / span if span > 0 else 0.0, "busy_us": busy, "span_us": span,
            "kernels": len(spans)}


def gpu_idle(run, device: torch.device, steps: int) -> dict | None:
    """Profile `steps` consecutive run() calls (CUDA activity only, so tracing adds no host work to them)."""
    if device.type != "cuda":
        return None
    import warnings

    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "Profiler clears events at the end of each cycle": one cycle here
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            _sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    out = idle_from_trace(events)
    if out is not None:
        out["idle_ms_per_step"] = (out["span_us"] - out["busy_us"]) / 1e3 / steps
        out["gpu_ops_per_step"] = out["kernels"] / steps          # kernels + memcpy / memset: the launches
        out["top_kernels"] = top_kernels(events, steps)
    return out


def top_kernels(events: list[dict], steps: int, top: int = TOP_KERNELS) -> list[dict]:
    """Where a step's GPU time goes: the `top` GPU activities (grouped by full name) by total time, per step, each
    {name (cut to 120 characters), us (per step), calls (per step), share (of all GPU activity time)}."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in BUSY_CATEGORIES:
            acc = by_name.setdefault(str(e.get("name", "?")), [0.0, 0])
            acc[0] += float(e.get("dur", 0))
            acc[1] += 1
    total = sum(us for us, _ in by_name.values()) or 1.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name[:120], "us": us / steps, "calls": calls / steps, "share": us / total}
            for name, (us, calls) in ranked]


# ------------------------------------------------------------------------------------------- engine glue
# NOTE: the fallbacks below (no StepProbe, no dispatch recorder, no LLM.engine) are how the same code measures a
# pre-rebuild engine (reports/1/step-h200-method/); this build always takes the first branch.

def default_probe_factory():
    """deepinfer.runner.probe.StepProbe, or one error line when this build has none."""
    try:
        from deepinfer.runner.probe import StepProbe
    except ImportError as e:
        raise DeepInferError(f"deepinfer-bench step needs deepinfer.runner.probe.StepProbe, which this build "
                             f"cannot import ({e})") from None
    return StepProbe


def record_routing():
    """The dispatch recorder (a context manager yielding an object with .calls), or None without one."""
    try:
        from deepinfer.parallel.dispatch import record_routing as rec
    except ImportError:
        return None
    return rec


@contextlib.contextmanager
def routing_recorder(model):
    """Collects the routed ids of one eager forward two ways: the dispatcher's record_routing() (calls
    "dispatch") and forward hooks on each MoE's router (calls "gate": the (weights, ids) it returns, named after
    the MoE module), for builds whose MoE does not go through a dispatcher. Yields {"dispatch": [...],
    "gate": [...]}, lists of (MoE name, ids [N, k]), filled when the block exits."""
    out = {"dispatch": [], "gate": []}
    hooks = []
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if isinstance(gate, torch.nn.Module) and hasattr(module, "experts"):
            def hook(_mod, _args, result, name=name):
                if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], torch.Tensor):
                    out["gate"].append((name, result[1].detach()))
            hooks.append(gate.register_forward_hook(hook))
    rec_cm = record_routing()
    try:
        with (rec_cm() if rec_cm is not None else contextlib.nullcontext()) as rec:
            yield out
        if rec is not None:
            out["dispatch"].extend(rec.calls)
    finally:
        for h in hooks:
            h.remove()


def label_moe(model) -> None:
    try:
        from deepinfer.parallel.dispatch import label_dispatchers
    except ImportError:
        return
    label_dispatchers(model)


def _engine(llm):
    """The engine core (LLM.engine) or, in older builds, the LLM itself."""
    return getattr(llm, "engine", None) or llm


@contextlib.contextmanager
def engine_context(llm):
    """Inference mode and the engine's kernel table around probe calls (the probe sets them too)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        kernels = getattr(_engine(llm), "kernels", None)
        if kernels is not None:
            from deepinfer.kernels.table import use
            stack.enter_context(use(kernels))
        yield


def eager_run(probe, llm) -> str:
    """One run() outside graph replay (Python must run for the recorder to see the routing); returns how.
    A graph replay (or its capture, which runs on scratch rows) would record nothing, or the wrong rows."""
    probe.run(eager=True)
    return "probe.run(eager=True)"


def kernel_info(llm) -> tuple[str | None, dict | None]:
    stats = getattr(llm, "stats", None)
    stats = stats() if callable(stats) else stats
    if stats is not None and getattr(stats, "kernel_backend", None):
        return stats.kernel_backend, dict(getattr(stats, "kernel_backends", {}) or {})
    kernels = getattr(_engine(llm), "kernels", None)
    return getattr(kernels, "name", None), dict(getattr(kernels, "backends", {}) or {})


def check_model(spec: str, expert_storage: str = "dense") -> None:
    """The model's form (deepinfer.validate) and, for random:ARCH:PRESET:LAYERS, that the preset has that many
    layers, without building anything (one error line if it is wrong)."""
    check_model_spec(spec)
    if spec.startswith("random:"):
        check_expert_storage(expert_storage, spec.split(":")[1])
        from deepinfer.config.presets import preset_config
        _, arch, preset, layers = spec.split(":")
        preset_config(arch, preset, int(layers))


def build_engine(cfg: StepConfig):
    from deepinfer import LLM
    from deepinfer.api import resolve_model
    model = resolve_model(cfg.model, cfg.device, cfg.dtype, cfg.expert_storage,
                          projection_storage=cfg.projection_storage)
    return LLM(model=model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, **cfg.engine_args())


def check_storage(inv: Inventory, wanted: str) -> str:
    got = sorted({i.storage for i in inv.experts.values()}) or ["none"]
    if inv.experts and got != [wanted]:
        raise DeepInferError(f"--expert-storage {wanted}: the built model keeps its routed experts {'/'.join(got)} "
                             f"(random deepseek_v4 models are built with dense experts); use --expert-storage "
                             f"{got[0]} or a model that supports {wanted}")
    return got[0]


# -------------------------------------------------------------------------------------------------- the run

def measure_point(llm, probe_cls, point: StepPoint, cfg: StepConfig, inv: Inventory, ceilings: dict) -> dict:
    """One point's measured and roofline fields."""
    device = torch.device(cfg.device)
    probe = probe_cls(llm, batch_size=point.batch, context_len=point.context, query_len=point.query_len,
                      seed=cfg.seed)
    try:
        with engine_context(llm):
            with routing_recorder(llm.model) as calls:
                how = eager_run(probe, llm)
                _sync(device)
            routing = routing_from_calls(calls["dispatch"] or calls["gate"],
                                         {n: info.n_experts for n, info in inv.experts.items()})
            routing.recorded = bool(calls["dispatch"] or calls["gate"])
            routing.source = "dispatch" if calls["dispatch"] else "gate" if calls["gate"] else None
            for _ in range(cfg.warmup):
                probe.run()
            _sync(device)
            timing = time_steps(probe.run, device, cfg.iters)
            idle = gpu_idle(probe.run, device, cfg.trace_steps)
        graphed, state_bytes = bool(probe.graphed), int(probe.state_bytes_read)
        logit_rows = getattr(probe, "logit_rows", None)
        if logit_rows is None and hasattr(getattr(probe, "inputs", None), "logit_rows"):
            logit_rows = len(probe.inputs.logit_rows)         # StepProbe: prefill computes the last row's logits
    finally:
        probe.close()
    traffic = step_traffic(inv, routing, point, state_bytes, llm.model.cfg, logit_rows)
    roof = roofline(traffic["bytes"]["total"], traffic["flops"]["total"], ceilings["copy_bytes_per_s"],
                    ceilings["gemm_flops_per_s"])
    return {**timing, **traffic, **roof, "ratio": timing["step_ms_median"] / roof["roofline_ms"],
            "graphed": graphed, "routing_recorded": routing.recorded, "routing_source": routing.source,
            "routing_run": how,
            "routing_rows": routing.rows,
            "experts_touched_per_layer": {k: v for k, v in routing.touched.items() if k in inv.experts},
            "expert_traffic": traffic_summary(routing.layers),
            "routing_outside_step_layers": sorted(k for k in routing.touched if k not in inv.experts),
            "gpu_idle_fraction": None if idle is None else idle["idle_fraction"],
            "gpu_idle_ms_per_step": None if idle is None else idle["idle_ms_per_step"],
            "gpu_ops_per_step": None if idle is None else idle["gpu_ops_per_step"],
            "gpu_trace": idle, "trace_steps": cfg.trace_steps if idle is not None else 0}


def comparable(settings: dict) -> dict:
    """A run's settings as --resume compares them: without the point lists (they may grow), and without options
    at their defaults that runs from before the option did not record (expert_act_quant off, dense projections)."""
    defaults = {"expert_act_quant": False, "projection_storage": "dense", "kv_cache_dtype": "auto"}
    return {k: v for k, v in settings.items() if k not in ("batches", "contexts", "prefill")
            and not (k in defaults and v == defaults[k])}


def check_run(cfg: StepConfig, run_dir: Path, resume: bool) -> set[str]:
    """Before anything is written: --resume against the stored definition (or refuse to reuse a run with rows);
    returns the keys of the points already done."""
    stored = run_dir / "step.json"
    if resume:
        if not stored.exists():
            raise DeepInferError(f"--resume: no step run {run_dir} (no step.json there); check --run-id / --out")
        try:
            before = json.loads(stored.read_text())
        except ValueError:
            before = {}
        old = comparable(before)
        if old != cfg.identity():
            diff = sorted(k for k in {*old, *cfg.identity()} if old.get(k) != cfg.identity().get(k))
            raise DeepInferError(f"--resume: {stored} was run with other settings ({', '.join(diff)}); resume with "
                                 f"the same model / dtype / storage / backend / device / timing, or a new --run-id")
    else:
        refuse_existing_rows(run_dir)
    return done_keys(read_rows(run_dir))


def open_run(cfg: StepConfig, run_dir: Path) -> tuple[RowStore, dict]:
    """Once the engine is built: the run directory (step.json, env.json unless a resumed run has one) and its store."""
    store = RowStore(run_dir)
    env = environment()
    atomic_write_text(run_dir / "step.json", json.dumps(cfg.to_dict(), indent=1, sort_keys=True) + "\n")
    if not (run_dir / "env.json").exists():
        atomic_write_text(run_dir / "env.json", json.dumps(env, indent=1, sort_keys=True) + "\n")
    return store, env


def run_step_bench(cfg: StepConfig, report_dir: str | os.PathLike = "reports", run_id: str | None = None,
                   out: str | os.PathLike | None = None, resume: bool = False, continue_on_error: bool = False,
                   probe_factory=None, echo=None) -> tuple[Path, list[dict]]:
    """Measure every point of cfg not yet done in the run directory; returns (run dir, every row there). The
    directory is made once the checks pass and the engine is built, and removed if the run fails before its first
    row (unless it existed before)."""
    echo = echo or (lambda s: None)
    check_device(cfg.device)
    run_dir = run_dir_for(report_dir, run_id, out, "step")
    probe_cls = (probe_factory or default_probe_factory)()        # fail before any device work
    check_model(cfg.model, cfg.expert_storage)
    cfg.check_positions()
    check_kernel_backend(cfg.kernel_backend, cfg.device)
    done = check_run(cfg, run_dir, resume)
    todo = [p for p in cfg.points() if p.key not in done]
    if not todo:
        return run_dir, read_rows(run_dir)
    echo(f"ceilings on {cfg.device} ...")
    ceilings = measure_ceilings(cfg.device, parse_dtype(cfg.dtype))
    extra = [f"{name} {ceilings[k] / 1e12:.1f}" for name, k in (("bf16", "gemm_bf16_flops_per_s"),
                                                                ("fp8", "fp8_flops_per_s")) if ceilings[k]]
    echo(f"  copy {ceilings['copy_bytes_per_s'] / 1e12:.3f} TB/s (read+write), GEMM {cfg.dtype} "
         f"{ceilings['gemm_flops_per_s'] / 1e12:.3f} TFLOP/s" + "".join(f", {e}" for e in extra))
    t0 = time.perf_counter()
    llm = build_engine(cfg)
    label_moe(llm.model)
    inv = inventory(llm.model)
    storage = check_storage(inv, cfg.expert_storage)
    echo(f"engine built in {time.perf_counter() - t0:.1f} s; {len(todo)} points")
    with run_dir_guard(run_dir):
        store, env = open_run(cfg, run_dir)
        identity = _identity(cfg, llm, run_dir.name, storage, probe_cls, ceilings, env)
        for point in todo:
            _measure_one(llm, probe_cls, point, cfg, inv, ceilings, store, identity, continue_on_error, echo)
    return run_dir, store.rows()


def _identity(cfg: StepConfig, llm, run_name: str, storage: str, probe_cls, ceilings: dict, env: dict) -> dict:
    """The fields every row of the run carries."""
    backend, backends = kernel_info(llm)
    mcfg = llm.model.cfg
    return {"schema_version": SCHEMA_VERSION, "method_version": STEP_METHOD_VERSION, "bench": "step",
            "mode": "step", "run_id": run_name, "model": cfg.model, "model_type": mcfg.model_type,
            "layers": mcfg.num_hidden_layers, "config_hash": mcfg.config_hash(), "precision": cfg.dtype,
            "expert_storage": storage, "expert_act_quant": cfg.expert_act_quant,
            "projection_storage": cfg.projection_storage, "kv_cache_dtype": cfg.kv_cache_dtype,
            "kernel_backend": backend,
            "kernel_backends": backends,
            "device": cfg.device, "hardware": env["hardware"]["gpu"] or env["hardware"]["cpu"],
            "hardware_info": env["hardware"], "engine": "deepinfer", "git_sha": env["git"]["sha"],
            "git_dirty": env["git"]["dirty"], "packages": env["packages"], "seed": cfg.seed,
            "cuda_graphs_allowed": cfg.graphs, "iters": cfg.iters, "warmup": cfg.warmup,
            "probe": f"{probe_cls.__module__}.{probe_cls.__qualname__}", "ceilings": ceilings,
            "is_projected": False}


def _measure_one(llm, probe_cls, point: StepPoint, cfg: StepConfig, inv: Inventory, ceilings: dict,
                 store: RowStore, identity: dict, continue_on_error: bool, echo) -> None:
    """One point's row (a failure row when it raises; without continue_on_error the run then stops)."""
    row = {**identity, "key": point.key, "shape": point.shape, "batch": point.batch, "context": point.context,
           "query_len": point.query_len, "tokens": point.rows, "started": utc_now()}
    t1 = time.perf_counter()
    try:
        fields = measure_point(llm, probe_cls, point, cfg, inv, ceilings)
    except Exception as e:        # noqa: BLE001  a failed point is recorded, never silently lost
        error = str(e) if isinstance(e, DeepInferError) else f"{type(e).__name__}: {e}"
        store.append({**row, "status": "failed", "error": error, "finished": utc_now()})
        first = (error.strip().splitlines() or [""])[0]     # CUDA errors run over lines: the row keeps them all
        echo(f"  {point.key}: failed ({first})")
        if not continue_on_error:
            raise DeepInferError(f"point {point.key} failed ({first}); its failure row is in {store.path}; "
                                 f"rerun with --resume (and --continue-on-error to go on past failures)") from e
        return
    store.append({**row, **fields, "status": "ok", "finished": utc_now()})
    echo(f"  {point.key}: {fields['step_ms_median']:.3f} ms (roofline {fields['roofline_ms']:.3f} ms, "
         f"x{fields['ratio']:.1f}) in {time.perf_counter() - t1:.1f} s")


def table(rows: list[dict]) -> list[str]:
    """The end-of-run table: one line per finished point (the latest row of each key)."""
    latest = {}
    for r in rows:
        if r.get("status") == "ok":
            latest[r["key"]] = r
    head = f"{'point':<24} {'graph':>5} {'median ms':>10} {'p90 ms':>9} {'roofline':>9} {'bound':>7} " \
           f"{'ratio':>7} {'experts':>9} {'GB':>8} {'idle':>6}  {TRAFFIC_HEADER}"
    lines = [head]
    for r in latest.values():
        idle = "n/a" if r.get("gpu_idle_fraction") is None else f"{100 * r['gpu_idle_fraction']:.0f}%"
        lines.append(f"{r['key']:<24} {'yes' if r['graphed'] else 'no':>5} {r['step_ms_median']:>10.3f} "
                     f"{r['step_ms_p90']:>9.3f} {r['roofline_ms']:>9.4g} {r['bound']:>7} {r['ratio']:>7.2f} "
                     f"{str(r['experts_touched']) + '/' + str(r['experts_total']):>9} "
                     f"{r['bytes']['total'] / 1e9:>8.3f} {idle:>6}  {traffic_cell(r):<24}")
    return lines
