"""`deepinfer-bench sweep`: run every point of a sweep definition on the engine and write one row per point.

Run directory: `<report_dir>/<schema_version>/<run_id>/` with `sweep.yaml` (the normalized definition),
`env.json` (identity and environment), `rows.jsonl` and `raw/<point>.json` (vLLM-bench-compatible). It is made
once every check has passed and the engine is built (a bad device, model or --resume leaves nothing), and
removed again when the run fails before its first row. Points are independent and each row is durable when
written, so `--resume` (same run id) skips finished points and a killed sweep loses at most the point it was
running; a failing point writes a failure row and, with `--continue-on-error`, the sweep goes on.

Point semantics (docs/bench.md): prefill points feed random prompts of the scenario's ISL and generate one
token (input tokens/s per GPU against TTFT); decode points run the scenario's ISL/OSL (output tokens/s per GPU
against tokens/s/user = 1000 / median TPOT in ms). Warm-up requests run before each point, unmeasured."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import logging
import os
import time
from pathlib import Path

import yaml

from deepinfer.errors import DeepInferError
from deepinfer.speculative.config import speculation_label
from deepinfer.validate import check_device

from .metrics import RequestTiming, chunk_gaps, compute_metrics
from .ranks import Ranks, barrier, gather, share, split
from .ranks import finish as finish_ranks
from .ranks import init as init_ranks
from .prefix_fields import prefix_fields
from .host_time import host_fields
from .traffic import traffic_fields
from .expert_balance import balance_fields
from .bench import OnError, RunFolder, record_point
from .rows import (METHOD_VERSION, SCHEMA_VERSION, RowStore, environment, identity, kernel_fields, run_dir_guard,
                   run_id_for)
from .sweep_config import SweepConfig, SweepPoint, parse_sweep
from .workload import Workload, random_workload, run_turns, run_workload

log = logging.getLogger("deepinfer")
ENGINE_STAT_KEYS = ("steps", "preemptions", "graph_replays", "fed_tokens", "committed_tokens", "max_step_rows",
                    "max_step_tokens", "num_seats", "num_blocks")      # EngineStats fields a point row carries

# The README's main job: the embedded tiny model on CPU, about three minutes (= sweeps/tiny-cpu.yaml).
DEFAULT_SWEEP = {
    "name": "tiny-cpu", "model": "tiny", "device": "cpu", "dtype": "float32",
    "engine_args": {"max_num_seqs": 8, "max_num_batched_tokens": 1024, "max_model_len": 256},
    "mode": "both", "scenarios": [{"isl": 128, "osl": 32}, {"isl": 32, "osl": 128}], "range_ratio": 0.8,
    "concurrency": {"start": 1, "stop": 8}, "num_prompts_per_concurrency": 5, "warmup": 2, "seed": 0,
}


# What `deepinfer-bench sweep --decode-ranks 64` projects when no sweep file is given: the upstream charts' shape,
# 4 prefill and 64 decode ranks, V4.1-Flash, DSpark off / fixed / confidence (= sweeps/v41-flash-published.yaml, by
# test; docs/projection.md).
PUBLISHED_SWEEP = {
    "name": "v41-flash-published", "model": "deepseek-ai/DeepSeek-V4.1-Flash-1017", "device": "cuda",
    "dtype": "bfloat16",
    "engine_args": {"expert_storage": "fp4", "expert_dispatch": "deepep", "max_model_len": 9216, "max_num_seqs": 256,
                    "max_num_batched_tokens": 16384, "gpu_memory_utilization": 0.9},
    "mode": "both",
    "scenarios": [{"isl": 1024, "osl": 1024}, {"isl": 8192, "osl": 1024}, {"isl": 1024, "osl": 8192}],
    "range_ratio": 0.8, "topology": {"prefill_ranks": 4, "decode_ranks": 64, "ep": 64, "dp": 64},
    "concurrency": {"prefill": {"start": 1, "stop": 64}, "decode": {"start": 1, "stop": 16384}},
    "num_prompts_per_concurrency": 10, "warmup": 16, "seed": 0,
    "speculative": ["off", {"schedule": "fixed"}, {"schedule": "confidence"}],
}


def published_sweep(prefill_ranks: int | None = None, decode_ranks: int | None = None) -> dict:
    """PUBLISHED_SWEEP at other role sizes: the decode role one EP engine over its ranks, and the ladders the same per
    rank (prefill up to 16 prompts a rank, decode up to 256 sequences a rank)."""
    topo = dict(PUBLISHED_SWEEP["topology"])
    topo.update({k: v for k, v in (("prefill_ranks", prefill_ranks), ("decode_ranks", decode_ranks)) if v})
    topo["ep"] = topo["dp"] = topo["decode_ranks"]
    ladder = {"prefill": {"start": 1, "stop": 16 * topo["prefill_ranks"]},
              "decode": {"start": 1, "stop": 256 * topo["decode_ranks"]}}
    return {**PUBLISHED_SWEEP, "topology": topo, "concurrency": ladder}


class TopologyError(DeepInferError):
    """The sweep asks for more ranks than this launch has."""


def ranks_found(device: str) -> tuple[int, str]:
    """(ranks this launch can use, where the number comes from)."""
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "torchrun WORLD_SIZE"
    if device.startswith("cuda"):
        import torch
        return torch.cuda.device_count(), "local GPUs"
    return 1, "one CPU process"


def projection_reason(cfg: SweepConfig, project: bool = False, measure: bool = False) -> str | None:
    """Why this sweep is projected instead of measured (the notice line), or None: --project forces it; otherwise a
    GPU sweep of a model the projection knows (a flash-width random model, a released id), launched without
    torchrun on a machine with fewer GPUs than a role's ranks. --measure, CPU sweeps (their ranks are torchrun
    processes) and other models keep the measured path and its refusals."""
    if project:
        return "--project: every point is projected (docs/projection.md)"
    if measure or os.environ.get("WORLD_SIZE") or not cfg.device.startswith("cuda"):
        return None
    from .projection.sources import projectable
    if not projectable(cfg.model):
        return None
    found, where = ranks_found(cfg.device)
    short = [(m, cfg.topology.ranks(m)) for m in cfg.modes if cfg.topology.ranks(m) > max(found, 1)]
    if not short:
        return None
    asks = ", ".join(f"{n} {m}" for m, n in short)
    return (f"this launch has {found} rank{'s' if found != 1 else ''} ({where}) and the sweep asks for {asks} ranks: "
            f"every point is projected from committed calibration rows (docs/projection.md); --measure refuses "
            f"instead")


def check_topology(cfg: SweepConfig) -> None:
    found, where = ranks_found(cfg.device)
    for mode in cfg.modes:
        want = cfg.topology.ranks(mode)
        if want > 1 and ":" in cfg.device:
            raise TopologyError(f"device {cfg.device} pins one GPU, but {mode} points ask for {want} ranks: use device "
                                f"cuda (torchrun gives each rank its own GPU), or {mode}_ranks: 1")
        if want > found:
            raise TopologyError(
                f"the sweep asks for {want} {mode} ranks but this launch has {found} ({where}); launch it across "
                f"nodes with torchrun (e.g. torchrun --nnodes {-(-want // 8)} --nproc-per-node 8 ... "
                f"$(which deepinfer-bench) sweep ...), or lower --{mode}-ranks")
        if want > 1 and not os.environ.get("WORLD_SIZE"):
            raise TopologyError(f"{want} {mode} ranks: run one process per rank with torchrun, e.g. torchrun "
                                f"--nproc-per-node {want} $(which deepinfer-bench) sweep ...")
    _check_expert_parallel_launch(cfg, found)


def _check_expert_parallel_launch(cfg: SweepConfig, found: int) -> None:
    """An expert-parallel role is one engine over every rank of the launch (the engine's data_parallel_size is
    WORLD_SIZE), so the launch has exactly its ranks and every role that runs is that same engine."""
    ep = cfg.ep_ranks
    if ep == 1:
        return
    for mode in cfg.modes:
        if cfg.topology.ranks(mode) != ep:
            ep_mode = next(m for m in cfg.modes if cfg.topology.ep_of(m) == ep)
            raise TopologyError(f"topology: the {ep_mode} role runs one expert-parallel engine over the launch's "
                                f"{ep} ranks (ep {cfg.topology.ep}), and the {mode} role has {mode}_ranks="
                                f"{cfg.topology.ranks(mode)}: run the roles as two sweeps (mode: prefill / mode: "
                                f"decode), or give both roles {ep} ranks")
    if found != ep:
        raise TopologyError(f"topology ep={cfg.topology.ep}: the expert-parallel engine spans every rank of the "
                            f"launch, and this launch has {found}: start {ep} processes (torchrun --nproc-per-node "
                            f"(x --nnodes) = {ep})")


def build_llm(cfg: SweepConfig, device: str | None = None, spec: str = "", model=None):
    """The sweep's engine, on `device` (default: the sweep's; a rank of a multi-GPU launch passes its own GPU),
    for the points of one `speculative` setting (spec: its label; "" the engine_args' own); model: one already
    built (the settings of a sweep share it)."""
    from deepinfer import LLM
    from deepinfer.api import resolve_model
    args = dict(cfg.engine_args)
    # under expert parallelism the engine takes `cuda` and gives each rank its own GPU itself (parallel.ranks.join)
    device = cfg.device if cfg.ep_ranks > 1 or device is None else device
    if model is None:
        model = resolve_model(cfg.model, device, cfg.dtype, args.get("expert_storage", "dense"),
                              projection_storage=args.get("projection_storage", "dense"))
    if cfg.speculative:
        args["speculative"] = cfg.speculative_value(spec)
    args.setdefault("expert_traffic", True)          # every row says how the model routed (harness/traffic.py)
    if cfg.ep_ranks > 1:                             # one engine over the launch's ranks (it joins their group)
        args.update(data_parallel_size=cfg.ep_ranks, enable_expert_parallel=True)
    return LLM(model=model, device=device, dtype=cfg.dtype, seed=cfg.seed, **args)


def spec_mode_of(llm) -> str:
    """A row's spec_mode: none, or <method>-<schedule>-<drafts> (the engine's speculative decoding)."""
    spec = getattr(llm, "speculative", None)
    return "none" if spec is None else speculation_label(spec)


def run_point(llm, cfg: SweepConfig, point: SweepPoint, index: int, ranks: Ranks = Ranks()) -> tuple[dict, dict]:
    """Measure one point -> (row fields, vLLM-style raw result). In a multi-rank launch every rank calls it; the
    point's requests are split over its replicas (harness/ranks.py) and every rank gets the merged result."""
    vocab = llm.model.cfg.vocab_size
    osl = 1 if point.mode == "prefill" else point.osl
    seed = cfg.seed * 1_000_003 + index
    work = random_workload(point.num_prompts, point.isl, osl, cfg.range_ratio, vocab, seed, shared=point.shared,
                           prefix_seed=seed)
    warmup = random_workload(point.warmup, point.isl, osl, cfg.range_ratio, vocab, seed + 7919,
                             shared=point.shared, prefix_seed=seed)
    sent, held = work.prompts, work.prompts          # what the timed requests sent, and left in the state
    if point.turns > 1 and ranks.world > 1:
        raise DeepInferError(f"turns: {point.turns}: multi-turn points run on one rank; drop turns or the launch's "
                             f"other ranks")
    if point.turns > 1:
        _check_concurrency(llm, point.concurrency)
        if warmup.prompts:
            run_workload(llm, warmup, point.concurrency)
        llm.engine.reset_stats()
        records, duration, sent, held = run_turns(llm, work, point.turns, point.concurrency, vocab, seed)
    elif ranks.world == 1:
        records, duration = _measure(llm, work, warmup, point.concurrency)
    else:                                # the prefix fields: this rank's engine over its share
        records, duration, sent = _measure_ranks(llm, work, warmup, point, ranks)
        held = sent
    metrics = compute_metrics(records, duration=duration, num_gpus=point.ranks)
    stats = llm.stats                    # this rank's engine, over the timed requests
    engine_stats = {k: getattr(stats, k) for k in ENGINE_STAT_KEYS}
    raw = {"date": _dt.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "deepinfer", "model_id": cfg.model,
           "num_prompts": point.num_prompts, "request_rate": "inf", "max_concurrency": point.concurrency,
           **metrics.to_vllm_dict(),
           "input_lens": [r.input_tokens for r in records], "output_lens": [r.output_tokens for r in records],
           "ttfts": [r.token_times[0] - r.start if r.success and r.token_times else 0.0 for r in records],
           "itls": [chunk_gaps(r) if r.success else [] for r in records]}
    return {**metrics.to_row(), "engine_stats": engine_stats, **traffic_fields(stats), **host_fields(stats),
            **prefix_fields(stats, sent, held, before=warmup.prompts), **_balance(llm, ranks)}, raw


def _balance(llm, ranks: Ranks) -> dict:
    """Balancedness of an expert-parallel point (harness/expert_balance.py) from every rank's traffic counters
    (gathered: every rank calls it); None values for an engine without expert parallelism."""
    if not llm.engine.config.lockstep or llm.traffic is None:
        return balance_fields([], {})
    return balance_fields(gather(ranks, llm.traffic.loads()), llm.traffic.expert_parallel_placement())


def _measure(llm, work: Workload, warmup: Workload, concurrency: int) -> tuple[list[RequestTiming], float]:
    """Warm-up (unmeasured), then the timed requests at `concurrency` on this engine."""
    _check_concurrency(llm, concurrency)
    if warmup.prompts:
        run_workload(llm, warmup, concurrency)
    llm.engine.reset_stats()             # the point's engine_stats count the timed requests only
    return run_workload(llm, work, concurrency)


def _check_concurrency(llm, concurrency: int) -> None:
    seats, budget = llm.engine.num_seats, llm.engine.max_num_batched_tokens
    if concurrency > min(seats, budget):
        raise DeepInferError(f"concurrency {concurrency} exceeds what the engine can run at once ({seats} "
                             f"seats in the state pools, {budget}-token step budget): raise engine_args "
                             f"max_num_seqs / max_num_batched_tokens (or the memory budget)")


def _measure_ranks(llm, work: Workload, warmup: Workload, point: SweepPoint, ranks: Ranks):
    """This rank's share of the point (none when the point's role has fewer ranks or concurrency), started after a
    barrier; timings relative to it are gathered, so every rank's requests sit on one clock.

    Data-parallel replicas run their shares apart, and a failure is gathered, so no rank waits forever. One
    expert-parallel engine (lockstep) steps on every rank together: every rank runs the warm-up and the timed
    part (LLM.generate_local), a rank without a share running idle steps until the others are done, and a failure
    inside them is raised (the other ranks' next collective fails with one line, docs/parallel.md). Returns every
    rank's records, the longest duration and this rank's prompts."""
    parts = split(point.concurrency, point.num_prompts, point.ranks)
    mine = parts[ranks.rank] if ranks.rank < len(parts) else None
    c, a, b = mine if mine is not None else (0, 0, 0)
    share = Workload(work.prompts[a:b], work.output_lens[a:b])
    lockstep = llm.engine.config.lockstep
    steps = lockstep or mine is not None         # whether this rank's engine steps during the point
    _check_concurrency(llm, parts[0][0])         # the largest share, on every rank alike, before any step
    error, records, duration = None, [], 0.0
    if steps and warmup.prompts:
        error, _ = _caught(lambda: run_workload(llm, warmup if c else Workload([], []), c, local=True), lockstep)
    barrier(ranks)
    llm.engine.reset_stats()             # a rank without a share reports an idle engine
    t0 = time.perf_counter()
    if steps and error is None:
        error, got = _caught(lambda: run_workload(llm, share, c, local=True), lockstep)
        duration = time.perf_counter() - t0
        records = [RequestTiming(r.start - t0, [t - t0 for t in r.token_times], r.input_tokens, r.output_tokens,
                                 r.success) for r in (got[0] if got else [])]
    everyone = gather(ranks, (error, records, duration))
    failed = [f"rank {i}: {err}" for i, (err, _, _) in enumerate(everyone) if err]
    if failed:
        raise DeepInferError("; ".join(failed))
    return [r for _, recs, _ in everyone for r in recs], max(d for _, _, d in everyone), share.prompts


def _caught(fn, lockstep: bool) -> tuple[str | None, object]:
    """(None, fn()), or (fn's error as one line, None) for a replica, whose failure goes through the gather; under
    lockstep it is raised: the other ranks are inside the engine's collectives, not at the gather."""
    if lockstep:
        return None, fn()
    try:
        return None, fn()
    except Exception as e:               # noqa: BLE001  reported through the gather, so no rank waits forever
        return f"{type(e).__name__}: {e}", None


def run_sweep(cfg: SweepConfig, report_dir: str | os.PathLike, run_id: str | None = None, resume: bool = False,
              continue_on_error: bool = False, progress: bool = True) -> Path:
    """Run the sweep's points not yet done; returns the run directory. Under torchrun every rank calls this:
    rank 0 owns the files, the others run their replicas' shares."""
    check_device(cfg.device)             # one line on a machine without the GPU, before any topology advice
    check_topology(cfg)
    ranks = init_ranks(cfg.device)
    try:
        return _run_sweep(cfg, ranks, report_dir, run_id, resume, continue_on_error, progress)
    finally:
        finish_ranks(ranks)


def _run_sweep(cfg: SweepConfig, ranks: Ranks, report_dir, run_id, resume, continue_on_error, progress) -> Path:
    run_id = share(ranks, run_id_for(run_id, cfg.name))     # every rank checks its own; rank 0's time names it
    folder = RunFolder(Path(report_dir) / SCHEMA_VERSION / run_id, "sweep.yaml", resume)
    todo_keys = _on_main(ranks, lambda: _check_run(cfg, folder))
    per_setting = len(cfg.points()) // max(len(cfg.speculative), 1)     # a point's workload seed: its index among
    todo = [(i % per_setting, p) for i, p in enumerate(cfg.points()) if p.key in todo_keys]   # its setting's points
    if not todo:
        return folder.path
    groups: dict[str, list] = {}                             # one engine per speculative setting, in order
    for i, p in todo:
        groups.setdefault(p.spec, []).append((i, p))
    llm = build_llm(cfg, ranks.device(cfg.device), next(iter(groups)))   # a bad model fails here: no run dir yet
    with run_dir_guard(folder.path) if ranks.main else contextlib.nullcontext():
        env = environment()
        store = _on_main(ranks, lambda: folder.open(yaml.safe_dump(cfg.to_dict(), sort_keys=False), env))
        for n, (spec, points) in enumerate(groups.items()):
            if n:
                model = llm.model if cfg.ep_ranks == 1 else None     # an expert-parallel model holds its shard only
                del llm
                free_device_memory()
                llm = build_llm(cfg, ranks.device(cfg.device), spec, model)
            _run_points(llm, cfg, ranks, points, store if ranks.main else None,
                        _identity(llm, cfg, ranks, run_id, env), continue_on_error, progress and ranks.main)
    return folder.path


def free_device_memory() -> None:
    """Between two engines over one model: the first one's state pools and graphs go back before the next sizes
    its pools from free GPU memory."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _identity(llm, cfg: SweepConfig, ranks: Ranks, run_id: str, env: dict) -> dict:
    """The fields every row of the run carries."""
    return identity(env, METHOD_VERSION, hardware_info=True, run_id=run_id, sweep=cfg.name, model=cfg.model,
                    model_type=llm.model.cfg.model_type, config_hash=llm.model.cfg.config_hash(),
                    precision=cfg.dtype, device=cfg.device, engine="deepinfer", **kernel_fields(llm),
                    spec_mode=spec_mode_of(llm), is_projected=False, seed=cfg.seed,
                    topology=cfg.to_dict()["topology"], engine_args=dict(cfg.engine_args),
                    range_ratio=cfg.range_ratio, launch_ranks=ranks.world)


def _run_points(llm, cfg: SweepConfig, ranks: Ranks, todo: list, store: RowStore | None, identity: dict,
                continue_on_error: bool, progress: bool) -> None:
    """Measure each point; rank 0 (`store`) appends its row (a failure row when it raises)."""
    if cfg.warm_pass:
        _warm_pass(llm, cfg, ranks, todo, store is not None)
    bar = _progress(len(todo), progress)
    on_error = OnError(continue_on_error, describe=lambda e: f"{type(e).__name__}: {e}")
    warn = (lambda line: log.warning(line.strip())) if store is not None else None
    for i, point in todo:
        fields = {"mode": point.mode, "isl": point.isl, "osl": point.osl, "concurrency": point.concurrency,
                  "num_prompts": point.num_prompts, "warmup": point.warmup, "warm_pass": cfg.warm_pass,
                  "gpus": point.ranks, "shared_prefix": point.shared, "turns": point.turns,
                  **parallel_fields(cfg, point.mode)}
        t0 = time.perf_counter()
        row = record_point(store, identity, point.key, fields, lambda: run_point(llm, cfg, point, i, ranks),
                           on_error, warn)
        if store is not None and row["status"] == "ok":
            log.info(f"{point.key}: done in {time.perf_counter() - t0:.1f} s")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def _warm_pass(llm, cfg: SweepConfig, ranks: Ranks, todo: list, main: bool) -> None:
    """Every point once, unrecorded, with one request per concurrency slot: the shapes its timed steps run are
    compiled before any clock starts. Then the engine forgets what it cached (a timed point's prefix hits are its
    own warm-up's, as without the pass). On one rank a point that fails here is left to fail, recorded, when it is
    measured; a multi-rank launch stops (its ranks must meet the same collectives)."""
    t0 = time.perf_counter()
    for i, point in todo:
        try:
            run_point(llm, cfg, dataclasses.replace(point, num_prompts=point.concurrency), i, ranks)
        except Exception as e:                       # noqa: BLE001 - the timed run records it
            if ranks.world > 1:                      # ranks that part ways here would meet the wrong collectives
                raise
            log.warning(f"warm pass: {point.key}: {type(e).__name__}: {e}")
    llm.reset_prefix_cache()
    if main:
        log.info(f"warm pass: {len(todo)} points in {time.perf_counter() - t0:.1f} s")


def parallel_fields(cfg: SweepConfig, mode: str) -> dict:
    """How a point's role ran (every row, failed ones too): its ep and dp widths, whether it was one expert-parallel
    engine, that engine's dispatch backend and EPLB settings (defaults filled in; None when off)."""
    from deepinfer.llm import ENGINE_DEFAULTS
    from deepinfer.parallel.balancer import DEFAULTS as EPLB_DEFAULTS
    ep = cfg.topology.ep_of(mode)
    args = cfg.engine_args
    eplb = {**EPLB_DEFAULTS, **args["eplb_config"]} if ep > 1 and args.get("enable_eplb") else None
    return {"ep": ep, "dp": cfg.topology.dp_of(mode), "expert_parallel": ep > 1,
            "expert_dispatch": args.get("expert_dispatch", ENGINE_DEFAULTS["expert_dispatch"]) if ep > 1 else None,
            "eplb": eplb}


def _on_main(ranks: Ranks, fn):
    """fn() on rank 0 and its result on every rank; when it raises, every rank raises (none waits forever)."""
    result, error = None, None
    if ranks.main:
        try:
            result = fn()
        except Exception as e:           # noqa: BLE001  shared, so the other ranks stop too instead of waiting
            error = e
    message = None if error is None else str(error) if isinstance(error, DeepInferError) else \
        f"{type(error).__name__}: {error}"
    shared = share(ranks, ("ok", result) if error is None else ("error", message))
    if error is not None:
        raise error
    if shared[0] == "error":
        raise DeepInferError(shared[1])
    return result if ranks.main else shared[1]


def _check_run(cfg: SweepConfig, folder: RunFolder) -> list[str]:
    """Rank 0, before anything is written: check --resume against the stored definition (or refuse to reuse a run
    with rows); returns the keys of the points still to run."""
    def compare(stored: str) -> str | None:
        try:
            same = yaml.safe_load(stored) == cfg.to_dict()
        except yaml.YAMLError:
            same = False
        return None if same else (f"--resume: {folder.settings_path} differs from this sweep's definition; resume "
                                  f"with the same sweep, or start a new --run-id")
    done = folder.check(compare, "sweep")
    log.info(f"sweep {cfg.name}: {len(cfg.points())} points, {len(done)} already done, run dir {folder.path}")
    return [p.key for p in cfg.points() if p.key not in done]


def default_sweep() -> SweepConfig:
    return parse_sweep(DEFAULT_SWEEP, "<default tiny CPU sweep>")


def _progress(total: int, on: bool):
    if not on:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="sweep", unit="point")
