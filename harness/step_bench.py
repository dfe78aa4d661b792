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
  roofline  bytes the step must touch (dense weights, the routed experts, state) and FLOPs it must do
            (harness/step_roofline.py), over the measured ceilings; ratio = measured median / roofline."""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.cache.pools import KV_CACHE_DTYPES
from deepinfer.errors import DeepInferError
from deepinfer.kernels.table import use
from deepinfer.parallel.dispatch import label_dispatchers, record_routing
from deepinfer.validate import EXPERT_STORAGE, PROJECTION_STORAGE, check_device, parse_dtype

from .bench import OnError, RunFolder, json_text, record_point
from .ceilings import measure_ceilings, roofline
from .limits import Term, check_expert_parallel, check_kernel_backend, check_model, check_positions, model_limits
from .options import check_distinct
from .rows import environment, identity, kernel_fields, read_rows, run_dir_for, run_dir_guard
from .step_roofline import Inventory, Routing, check_storage, inventory, routing_from_calls, step_traffic
from .step_ranks import pool_rows, pool_shape, routing_pool, views
from .step_timing import gpu_idle, sync, time_steps
from .traffic import TRAFFIC_HEADER, traffic_cell, traffic_summary

STEP_METHOD_VERSION = "1"       # how step points are measured (bump when timing / accounting changes)
DEFAULT_MODEL = "random:deepseek_v4:tiny:4"


# --------------------------------------------------------------------------------------------- run definition

@dataclass(frozen=True)
class StepPoint:
    shape: str            # decode (q = 1), verify (q > 1 tokens per row), prefill (one row of T tokens)
    batch: int
    context: int          # positions already in each row's state
    query_len: int        # tokens each row feeds this step
    ep: int | None = None         # expert-parallel size of the rank view (--ep; None: no rank view)

    @property
    def key(self) -> str:
        if self.shape == "prefill":
            return f"prefill-t{self.query_len}"
        tail = "" if self.ep is None else f"-ep{self.ep}"
        return f"{self.shape}-b{self.batch}-c{self.context}-q{self.query_len}{tail}"

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
    ep: tuple[int, ...] = ()            # rank views of EP sizes (harness/step_ranks.py); () none
    ep_rank: int = 0                    # which rank of each EP group the view is
    eplb_redundant: int = 0             # EPLB slots beyond the experts per layer in the views (0: no EPLB)

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
        self._check_ranks()

    def _check_ranks(self) -> None:
        check_distinct("--ep", self.ep)
        if not self.ep:
            for given, option in ((self.ep_rank, "--rank"), (self.eplb_redundant, "--eplb-redundant")):
                if given:
                    raise DeepInferError(f"{option} sets up the expert-parallel rank view: add --ep")
            return
        if min(self.ep) < 1:
            raise DeepInferError("--ep sizes must be at least 1")
        if self.prefill:
            raise DeepInferError("--ep measures decode / verify steps of one rank; drop --prefill (or run it apart)")
        groups = [n for n in self.ep if n > 1]          # EP 1 is the plain step: no rank to pick
        if groups and not 0 <= self.ep_rank < min(groups):
            raise DeepInferError(f"--rank {self.ep_rank}: every --ep group must have it; use 0..{min(groups) - 1}")
        if self.eplb_redundant < 0:
            raise DeepInferError("--eplb-redundant must be at least 0")

    def points(self) -> list[StepPoint]:
        shape = "decode" if self.query_len == 1 else "verify"
        pts = [StepPoint(shape, b, c, self.query_len, ep) for ep in (self.ep or (None,))
               for c in self.contexts for b in self.batches]
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


# ------------------------------------------------------------------------------------------- engine glue

def default_probe_factory():
    """deepinfer.runner.probe.StepProbe, or one error line when this build has none."""
    try:
        from deepinfer.runner.probe import StepProbe
    except ImportError as e:
        raise DeepInferError(f"deepinfer-bench step needs deepinfer.runner.probe.StepProbe, which this build "
                             f"cannot import ({e})") from None
    return StepProbe


@contextlib.contextmanager
def routing_recorder(model):
    """Collects the routed ids of one eager forward two ways: the dispatcher's record_routing() (calls
    "dispatch") and forward hooks on each MoE's router (calls "gate": the (weights, ids) it returns, named after
    the MoE module), for MoE modules that do not go through a dispatcher. Yields {"dispatch": [...],
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
    recording = record_routing()
    try:
        with recording if recording is not None else contextlib.nullcontext() as rec:
            yield out
        if rec is not None:
            out["dispatch"].extend(rec.calls)
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def engine_context(llm):
    """Inference mode and the engine's kernel backend around probe calls (the probe sets them too)."""
    with torch.inference_mode(), use(llm.engine.kernel_backend):
        yield


def build_engine(cfg: StepConfig):
    from deepinfer import LLM
    from deepinfer.api import resolve_model
    model = resolve_model(cfg.model, cfg.device, cfg.dtype, cfg.expert_storage,
                          projection_storage=cfg.projection_storage)
    return LLM(model=model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, **cfg.engine_args())


# -------------------------------------------------------------------------------------------------- the run

def record_step_routing(llm, probe, inv: Inventory, device: torch.device) -> Routing:
    """The routing of one eager run() (Python must run for the recorder to see it: a graph replay, or its
    capture on scratch rows, would record nothing, or the wrong rows)."""
    with routing_recorder(llm.model) as calls:
        probe.run(eager=True)
        sync(device)
    routing = routing_from_calls(calls["dispatch"] or calls["gate"],
                                 {n: info.n_experts for n, info in inv.experts.items()})
    routing.recorded = bool(calls["dispatch"] or calls["gate"])
    routing.source = "dispatch" if calls["dispatch"] else "gate" if calls["gate"] else None
    return routing


def measure_step(llm, probe_cls, point: StepPoint, cfg: StepConfig, inv: Inventory, ceilings: dict) -> dict:
    """One point's measured and roofline fields."""
    device = torch.device(cfg.device)
    probe = probe_cls(llm, batch_size=point.batch, context_len=point.context, query_len=point.query_len,
                      seed=cfg.seed)
    try:
        with engine_context(llm):
            routing = record_step_routing(llm, probe, inv, device)
            for _ in range(cfg.warmup):
                probe.run()
            sync(device)
            timing = time_steps(probe.run, device, cfg.iters)
            idle = gpu_idle(probe.run, device, cfg.trace_steps)
        graphed, state_bytes = bool(probe.graphed), int(probe.state_bytes_read)
        logit_rows = getattr(probe, "logit_rows", None)      # None (a stand-in probe): every row's logits
    finally:
        probe.close()
    traffic = step_traffic(inv, routing, point, state_bytes, llm.model.cfg, logit_rows)
    roof = roofline(traffic["bytes"]["total"], traffic["flops"]["total"], ceilings["copy_bytes_per_s"],
                    ceilings["gemm_flops_per_s"])
    return {**timing, **traffic, **roof, "ratio": timing["step_ms_median"] / roof["roofline_ms"],
            "graphed": graphed, "routing_recorded": routing.recorded, "routing_source": routing.source,
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
    defaults = {"expert_act_quant": False, "projection_storage": "dense", "kv_cache_dtype": "auto", "ep_rank": 0,
                "eplb_redundant": 0}
    return {k: v for k, v in settings.items() if k not in ("batches", "contexts", "prefill", "ep")
            and not (k in defaults and v == defaults[k])}


def resume_difference(cfg: StepConfig, folder: RunFolder):
    """compare() for RunFolder.check: None when the stored step.json resumes as cfg, else the line saying why."""
    def compare(stored: str) -> str | None:
        try:
            before = json.loads(stored)
        except ValueError:
            before = {}
        old, now = comparable(before), cfg.identity()
        if old == now:
            return None
        diff = sorted(k for k in {*old, *now} if old.get(k) != now.get(k))
        return (f"--resume: {folder.settings_path} was run with other settings ({', '.join(diff)}); resume with "
                f"the same model / dtype / storage / backend / device / timing, or a new --run-id")
    return compare


def measure_ceilings_once(cfg: StepConfig, echo) -> dict:
    echo(f"ceilings on {cfg.device} ...")
    ceilings = measure_ceilings(cfg.device, parse_dtype(cfg.dtype))
    extra = [f"{name} {ceilings[k] / 1e12:.1f}" for name, k in (("bf16", "gemm_bf16_flops_per_s"),
                                                                ("fp8", "fp8_flops_per_s")) if ceilings[k]]
    echo(f"  copy {ceilings['copy_bytes_per_s'] / 1e12:.3f} TB/s (read+write), GEMM {cfg.dtype} "
         f"{ceilings['gemm_flops_per_s'] / 1e12:.3f} TFLOP/s" + "".join(f", {e}" for e in extra))
    return ceilings


def run_step_bench(cfg: StepConfig, report_dir: str | os.PathLike = "reports", run_id: str | None = None,
                   out: str | os.PathLike | None = None, resume: bool = False, continue_on_error: bool = False,
                   probe_factory=None, echo=None) -> tuple[Path, list[dict]]:
    """Measure every point of cfg not yet done in the run directory; returns (run dir, every row there). The
    directory is made once the checks pass and the engine is built, and removed if the run fails before its first
    row (unless it existed before)."""
    echo = echo or (lambda s: None)
    check_device(cfg.device)
    folder = RunFolder(run_dir_for(report_dir, run_id, out, "step"), "step.json", resume)
    probe_cls = (probe_factory or default_probe_factory)()        # fail before any device work
    check_model(cfg.model, cfg.expert_storage)
    check_expert_parallel(cfg.model, cfg.ep, cfg.eplb_redundant)
    cfg.check_positions()
    check_kernel_backend(cfg.kernel_backend, cfg.device)
    done = folder.check(resume_difference(cfg, folder), "step")
    todo = [p for p in cfg.points() if p.key not in done]
    if not todo:
        return folder.path, read_rows(folder.path)
    ceilings = measure_ceilings_once(cfg, echo)
    t0 = time.perf_counter()
    llm = build_engine(cfg)
    label_dispatchers(llm.model)
    inv = inventory(llm.model)
    storage = check_storage(inv, cfg.expert_storage)
    echo(f"engine built in {time.perf_counter() - t0:.1f} s; {len(todo)} points")
    with run_dir_guard(folder.path):
        env = environment()
        store = folder.open(json_text(cfg.to_dict()), env)
        ident = _identity(cfg, llm, folder.path.name, storage, probe_cls, ceilings, env)
        for view, points, view_inv in _groups(llm, cfg, probe_cls, inv, todo, echo):
            for point in points:
                _measure_point(store, ident, llm, probe_cls, point, cfg, view_inv, ceilings, view,
                               OnError(continue_on_error), echo)
    return folder.path, store.rows()


def _groups(llm, cfg: StepConfig, probe_cls, inv: Inventory, todo: list[StepPoint], echo):
    """(rank view or None, its points still to do, the inventory the view holds) per group of points."""
    if not cfg.ep:
        yield None, todo, inv
        return
    t0 = time.perf_counter()
    with engine_context(llm):
        pool = routing_pool(llm, probe_cls, pool_rows(cfg), pool_shape(cfg), cfg.seed)
    echo(f"routing pool: {pool_rows(cfg)} rows per layer in {time.perf_counter() - t0:.1f} s")
    keys = {p.key for p in todo}
    for size, view, points in views(llm, cfg, pool, {n: i.n_experts for n, i in inv.experts.items()}):
        points = [p for p in points if p.key in keys]
        if points:
            yield view, points, inv if view is None else inventory(llm.model)


def _measure_point(store, ident: dict, llm, probe_cls, point: StepPoint, cfg: StepConfig, inv: Inventory,
                   ceilings: dict, view, on_error: OnError, echo) -> None:
    t1 = time.perf_counter()
    fields = {"shape": point.shape, "batch": point.batch, "context": point.context,
              "query_len": point.query_len, "tokens": point.rows}
    if point.ep is not None:
        fields["ep_size"] = point.ep

    def measure() -> dict:
        out = measure_step(llm, probe_cls, point, cfg, inv, ceilings)
        return out if point.ep is None else {**out, "expert_parallel": view.exchange(point.rows) if view else None}
    row = record_point(store, ident, point.key, fields, measure, on_error, echo)
    if row["status"] == "ok":
        echo(f"  {point.key}: {row['step_ms_median']:.3f} ms (roofline {row['roofline_ms']:.3f} ms, "
             f"x{row['ratio']:.1f}) in {time.perf_counter() - t1:.1f} s")


def _identity(cfg: StepConfig, llm, run_name: str, storage: str, probe_cls, ceilings: dict, env: dict) -> dict:
    """The fields every row of the run carries."""
    mcfg = llm.model.cfg
    return identity(env, STEP_METHOD_VERSION, hardware_info=True, bench="step", mode="step", run_id=run_name,
                    model=cfg.model, model_type=mcfg.model_type, layers=mcfg.num_hidden_layers,
                    config_hash=mcfg.config_hash(), precision=cfg.dtype, expert_storage=storage,
                    expert_act_quant=cfg.expert_act_quant, projection_storage=cfg.projection_storage,
                    kv_cache_dtype=cfg.kv_cache_dtype, **kernel_fields(llm), device=cfg.device, engine="deepinfer",
                    seed=cfg.seed, cuda_graphs_allowed=cfg.graphs, iters=cfg.iters, warmup=cfg.warmup,
                    ep_rank=cfg.ep_rank if cfg.ep else None, eplb_redundant=cfg.eplb_redundant if cfg.ep else None,
                    probe=f"{probe_cls.__module__}.{probe_cls.__qualname__}", ceilings=ceilings, is_projected=False)


def table(rows: list[dict]) -> list[str]:
    """The end-of-run table: one line per finished point (the latest row of each key)."""
    latest = {}
    for r in rows:
        if r.get("status") == "ok":
            latest[r["key"]] = r
    head = f"{'point':<24} {'graph':>5} {'median ms':>10} {'p90 ms':>9} {'roofline':>9} {'bound':>7} " \
           f"{'ratio':>7} {'experts':>9} {'GB':>8} {'idle':>6}  {TRAFFIC_HEADER}"
    views = any("ep_size" in r for r in latest.values())
    lines = [head + ("  pairs  bal   a2a MB" if views else "")]
    for r in latest.values():
        idle = "n/a" if r.get("gpu_idle_fraction") is None else f"{100 * r['gpu_idle_fraction']:.0f}%"
        lines.append(f"{r['key']:<24} {'yes' if r['graphed'] else 'no':>5} {r['step_ms_median']:>10.3f} "
                     f"{r['step_ms_p90']:>9.3f} {r['roofline_ms']:>9.4g} {r['bound']:>7} {r['ratio']:>7.2f} "
                     f"{str(r['experts_touched']) + '/' + str(r['experts_total']):>9} "
                     f"{r['bytes']['total'] / 1e9:>8.3f} {idle:>6}  {traffic_cell(r):<24}" + _view_cells(r, views))
    return lines


def _view_cells(row: dict, views: bool) -> str:
    """pairs computed, balancedness (mean over layers), all-to-all MB sent + received: the rank view's columns."""
    ep = row.get("expert_parallel")
    if not views:
        return ""
    if not ep:
        return f"  {'-':>5} {'-':>4} {'-':>8}"
    return (f"  {ep['pairs_received']:>5} {ep['balancedness_mean']:>4.2f} "
            f"{(ep['bytes_sent'] + ep['bytes_received']) / 1e6:>8.2f}")
