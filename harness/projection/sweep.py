"""`deepinfer-bench sweep` on a machine without the sweep's ranks: every point projected, one row each, in the run
folder a measured sweep writes (docs/projection.md, "The projected sweep").

A projected row carries the measured row's metric fields (so summary.csv, the Pareto charts and `report --published`
read both alike) with `is_projected: true`, the projection's version, the calibration runs it came from (ids and
dates), the hardware profile, the dispatch backend and the flags of every value that is less than measured. The run
keeps `projection.json` (the sweep and the projection's settings) instead of sweep.yaml, and resumes like a measured
run: finished points are skipped, the settings must match."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deepinfer.errors import DeepInferError

from ..bench import OnError, RunFolder, json_text, record_point
from ..rows import SCHEMA_VERSION, environment, identity, run_dir_guard, run_id_for
from ..sweep_config import SweepConfig, SweepPoint
from . import hardware as hw
from .calibration import Calibration
from .prefill import PrefillStep, mean_len, project_prefill_step, schedule
from .sources import (DEFAULT_DISPATCH, PROJECTED_DISPATCH, PrefillCalibration, Target, comm_series,
                      decode_calibration, prefill_calibration, target_model)
from .step import ModelShape, Projected, project_decode

PROJECTION_VERSION = "1"
PROJECTION_SETTINGS = "projection.json"
DEFAULT_ACCEPTANCE = "v41-flash"        # the dspark bench's default curve (harness/dspark_bench.py CURVES)


@dataclass
class Projection:
    """What every projected point of one sweep shares."""
    target: Target
    shape: ModelShape
    hardware: hw.Profile                            # the GPU projected
    dispatch: str                                   # the engine's expert_dispatch the exchange is timed as
    decode: Calibration | None = None
    decode_on: hw.Profile | None = None             # the GPU the decode calibration ran on
    prefill: PrefillCalibration | None = None
    prefill_on: hw.Profile | None = None
    overlap: str = "two_micro_batches"
    overlap_share: float = 1.0                      # of the hideable exchange (fitted: validate.fitted_overlap)
    error_band: float | None = None                 # the published anchors' largest leave-one-out error

    def comm(self, phase: str, ep: int) -> tuple[dict, list[str]]:
        if ep == 1:
            return {}, []
        return comm_series(PROJECTED_DISPATCH[self.dispatch][phase], self.hardware, ep)

    def check(self, cfg: SweepConfig) -> None:
        """Before anything is written: every role's EP size is calibrated and its exchange has published series,
        and the sweep's numerics are the calibration's (one line each, else)."""
        for mode in cfg.modes:
            ep = cfg.topology.ep_of(mode)
            if mode == "decode" and ep not in self.decode.ep_sizes():
                raise DeepInferError(f"the decode role runs EP {ep}, and the calibration run {self.decode.run} has "
                                     f"rank views at EP {self.decode.ep_sizes()}: measure it with `deepinfer-bench "
                                     f"step --ep {ep} --rank 0 ...`, or pick a calibrated size")
            self.comm(mode, ep)
        runs = {"decode": self.decode, "prefill": self.prefill}
        for mode in cfg.modes:
            cal = runs[mode]
            asked = {"expert_storage": cfg.engine_args.get("expert_storage", "dense"), "precision": cfg.dtype}
            differ = {k: (v, cal.settings.get(k)) for k, v in asked.items()
                      if cal.settings.get(k) is not None and cal.settings[k] != v}
            if differ:
                said = ", ".join(f"{k} {a} (the calibration: {b})" for k, (a, b) in differ.items())
                raise DeepInferError(f"the sweep's {said} differ from the {mode} calibration run {cal.run}'s: "
                                     f"project with its settings, or calibrate with yours")

    def fields(self) -> dict:
        """The `projection` field of every row: where each term came from."""
        def cal(c, on):
            return None if c is None else {"run": c.run, "started": c.started, "model": c.model,
                                           "measured_on": c.hardware, "profile": on.name, "layers": c.layers}
        return {"version": PROJECTION_VERSION, "hardware": self.hardware.name,
                "hardware_version": self.hardware.version, "hardware_source": self.hardware.compute_source,
                "dispatch": self.dispatch, "overlap": self.overlap, "overlap_share": self.overlap_share,
                "layers": self.shape.layers,
                "calibration": {"decode": cal(self.decode, self.decode_on),
                                "prefill": cal(self.prefill, self.prefill_on)},
                "error_band": None if self.error_band is None else
                f"+-{self.error_band:.0%} on the published V3-class anchors (leave one out); not established for "
                f"V4 / V4.1 at scale (docs/projection.md, Validation)"}


def _profile_of(device_name: str, what: str) -> hw.Profile:
    found = hw.match(device_name)
    if found is None:
        raise DeepInferError(f"the {what} calibration ran on {device_name!r}, which has no hardware profile; add it "
                             f"to harness/projection/data/hardware.json")
    return found


def build_projection(cfg: SweepConfig, report_dir, hardware: str | None = None, calibration: str | None = None
                     ) -> Projection:
    """The projection of `cfg`'s model and roles, calibrated from the runs under `report_dir` (`calibration`: the
    decode calibration run's id), onto `hardware` (a profile name; default: the decode calibration's GPU)."""
    return projection_for(cfg.model, cfg.engine_args.get("expert_dispatch", DEFAULT_DISPATCH), cfg.modes,
                          report_dir, hardware, calibration)


def projection_for(model: str, dispatch: str, modes, report_dir, hardware: str | None = None,
                   calibration: str | None = None) -> Projection:
    """The projection of `model` for the roles `modes` ("prefill", "decode") with the engine's `dispatch`."""
    target = target_model(model)
    if dispatch not in PROJECTED_DISPATCH:
        raise DeepInferError(f"expert_dispatch={dispatch!r} has no published series to project it with; use one of "
                             f"{sorted(PROJECTED_DISPATCH)} (or leave it out: {DEFAULT_DISPATCH})")
    decode = decode_calibration(report_dir, target, calibration) if "decode" in modes else None
    prefill = prefill_calibration(report_dir, target) if "prefill" in modes else None
    decode_on = _profile_of(decode.hardware, "decode") if decode else None
    prefill_on = _profile_of(prefill.hardware, "prefill") if prefill else None
    profile = hw.profile(hardware) if hardware else (decode_on or prefill_on)
    from .validate import fitted_overlap
    share, band = fitted_overlap()
    return Projection(target, ModelShape.of(target.cfg), profile, dispatch, decode, decode_on, prefill, prefill_on,
                      overlap_share=share, error_band=band)


def _speculative(cfg: SweepConfig, point: SweepPoint):
    from deepinfer.speculative.config import speculative_config
    from deepinfer.validate import drafter_of_spec
    value = cfg.speculative_value(point.spec)
    return speculative_config(False if value is None else value, 5, drafter_of_spec(cfg.model))


def _survival(spec) -> tuple[tuple[float, ...], str]:
    from ..dspark_bench import CURVES
    if spec.acceptance is not None:
        return tuple(spec.acceptance), "the sweep's pinned acceptance"
    return CURVES[DEFAULT_ACCEPTANCE], f"acceptance: the dspark bench's {DEFAULT_ACCEPTANCE} curve"


@dataclass(frozen=True)
class DecodeStep:
    projected: Projected            # the step at the chosen verify length
    verified_drafts: int
    accepted: float                 # tokens a sequence commits a step
    flags: tuple[str, ...]

    @property
    def tpot_s(self) -> float:
        return self.projected.step_ms / self.accepted / 1e3


def decode_step(proj: Projection, ep: int, batch: int, context: float, spec) -> DecodeStep:
    """One decode step of a rank holding `batch` sequences at `context`: without speculation one token a step; with
    it, k drafts verified a step (fixed: all; confidence / budget: the k whose accepted tokens per step time is
    best at this load, read off the acceptance curve) committing AL(k) = 1 + s_1 + .. + s_k."""
    comm, flags = proj.comm("decode", ep)

    def step(k: int, accepted: float):
        return project_decode(proj.decode, proj.decode_on, proj.hardware, proj.shape, comm, ep, batch,
                              round(context), proj.overlap, accepted, k + 1, proj.overlap_share)
    if spec is None:
        best, k, accepted = step(0, 1.0), 0, 1.0
    else:
        survival, source = _survival(spec)
        survival = survival[:spec.num_speculative_tokens]
        flags.append(source)
        options = [(k, 1 + sum(survival[:k])) for k in range(len(survival) + 1)]
        if spec.schedule == "fixed":
            options = options[-1:]
        else:
            flags.append(f"{spec.schedule} schedule: the drafts verified per step are the k in 0..{len(survival)} "
                         f"with the most accepted tokens per step time at this load")
        best, k, accepted = max(((step(k, al), k, al) for k, al in options), key=lambda t: t[0].output_tok_s_per_rank)
    return DecodeStep(best, k, accepted, tuple(dict.fromkeys(flags + list(best.flags))))


def decode_fields(proj: Projection, cfg: SweepConfig, point: SweepPoint) -> dict:
    """A decode point: each rank of the role holds ceil(c / ranks) sequences at the mean context of their
    generation (decode_step)."""
    batch = math.ceil(point.concurrency / point.ranks)
    context = mean_len(point.isl, cfg.range_ratio) + mean_len(point.osl, cfg.range_ratio) / 2
    got = decode_step(proj, cfg.topology.ep_of("decode"), batch, context, _speculative(cfg, point))
    osl = mean_len(point.osl, cfg.range_ratio)
    duration = math.ceil(point.num_prompts / point.concurrency) * osl * got.tpot_s
    out = point.concurrency * got.accepted / (got.projected.step_ms / 1e3)
    fields = _metrics(point, cfg, duration, output_throughput=out, tpot=got.tpot_s,
                      itl=got.projected.step_ms / 1e3, ttfts=None, e2el=osl * got.tpot_s)
    return {**fields, "projected_step": {**got.projected.fields(), "batch_per_rank": batch, "context": round(context),
                                         "verified_drafts": got.verified_drafts, "accepted_per_step": got.accepted},
            "flags": list(got.flags) + ["decode role only: TTFT belongs to the prefill role's rows"]}


def prefill_fields(proj: Projection, cfg: SweepConfig, point: SweepPoint, index: int) -> dict:
    """A prefill point: the point's prompts (the lengths a measured sweep would draw) through the chunked-prefill
    schedule of the role's ranks, each step projected."""
    from deepinfer.llm import ENGINE_DEFAULTS

    from ..workload import random_workload
    ep = cfg.topology.ep_of("prefill")
    budget = cfg.engine_args.get("max_num_batched_tokens", ENGINE_DEFAULTS["max_num_batched_tokens"])
    comm, flags = proj.comm("prefill", ep)
    steps: dict[float, PrefillStep] = {}

    seed = cfg.seed * 1_000_003 + index
    lens = [len(p) for p in random_workload(point.num_prompts, point.isl, 1, cfg.range_ratio, proj.shape.vocab,
                                            seed).prompts]           # the lengths a measured sweep draws
    prompt_len = sum(lens) / len(lens)

    def step_ms(tokens: float) -> float:
        if tokens not in steps:
            steps[tokens] = project_prefill_step(proj.prefill, proj.prefill_on, proj.hardware, proj.shape, comm, ep,
                                                 tokens, prompt_len, proj.overlap, proj.overlap_share)
        return steps[tokens].step_ms
    plan = schedule(lens, point.concurrency, point.ranks, budget, step_ms)
    for s in steps.values():
        flags += list(s.flags)
    flags += list(plan.flags) + ["balanced routing assumed (every rank's experts get T x top_k / EP pairs)"]
    fields = _metrics(point, cfg, plan.duration, output_throughput=point.num_prompts / plan.duration, tpot=None,
                      itl=None, ttfts=plan.ttfts, e2el=plan.ttfts, input_tokens=sum(lens))
    full = step_ms(budget)
    return {**fields, "projected_step": {"tokens": budget, "step_ms": full, "compute_ms": steps[budget].compute_ms,
                                         "comm_ms": steps[budget].comm_ms},
            "flags": list(dict.fromkeys(flags))}


def _metrics(point: SweepPoint, cfg: SweepConfig, duration: float, output_throughput: float, tpot, itl, ttfts, e2el,
             input_tokens: float | None = None) -> dict:
    """The measured row's metric fields (harness/metrics.py's BenchMetrics.to_row, so the same names, seconds and NaN
    for a metric without samples) from a projected point. A latency is a list of samples (prefill TTFTs) or one
    value every request shares (a decode point's TPOT: all its requests run at the same step), or None (no sample:
    a decode row's TTFT belongs to the prefill role). ITL is the step (a speculative step's tokens arrive
    together, as the measured chunks do)."""
    from ..metrics import BenchMetrics, summarize
    inputs = input_tokens if input_tokens is not None else point.num_prompts * mean_len(point.isl, cfg.range_ratio)

    def stat(value):
        return summarize([] if value is None else list(value) if isinstance(value, (list, np.ndarray)) else [value])
    metrics = BenchMetrics(point.num_prompts, 0, round(inputs), round(output_throughput * duration), duration,
                           point.num_prompts / duration, inputs / duration, output_throughput,
                           inputs / duration + output_throughput, point.ranks,
                           stat(ttfts), stat(tpot), stat(itl), stat(e2el))
    return metrics.to_row()


def _check_resume(folder: RunFolder, settings: dict) -> set[str]:
    import json

    def compare(stored: str) -> str | None:
        try:
            same = json.loads(stored) == json.loads(json_text(settings))
        except json.JSONDecodeError:
            same = False
        return None if same else (f"--resume: {folder.settings_path} differs from this projection (sweep, "
                                  f"calibration or hardware); resume with the same settings, or start a new --run-id")
    return folder.check(compare, "projected sweep")


def run_projected_sweep(cfg: SweepConfig, report_dir, run_id: str | None = None, resume: bool = False,
                        hardware: str | None = None, calibration: str | None = None,
                        on_error: OnError = OnError(), echo=print) -> Path:
    """Project every point of `cfg` not yet done; returns the run directory (docs/projection.md)."""
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise DeepInferError("a projection runs in one process: launch it without torchrun")
    cached = sorted({s.label for ss in cfg.scenarios.values() for s in ss if s.shared or s.turns > 1})
    if cached:
        raise DeepInferError(f"scenarios {cached} share prefixes, which the projection does not model (it prices "
                             f"every prompt token): measure them, or drop shared / turns")
    proj = build_projection(cfg, report_dir, hardware, calibration)      # a missing calibration: nothing written
    proj.check(cfg)
    run_id = run_id_for(run_id, cfg.name + "-projected")
    folder = RunFolder(Path(report_dir) / SCHEMA_VERSION / run_id, PROJECTION_SETTINGS, resume)
    settings = {"sweep": cfg.to_dict(), "projection": proj.fields()}
    done = _check_resume(folder, settings)
    per_setting = len(cfg.points()) // max(len(cfg.speculative), 1)
    todo = [(i % per_setting, p) for i, p in enumerate(cfg.points()) if p.key not in done]
    echo(f"projected sweep {cfg.name}: {len(cfg.points())} points, {len(done)} already done, run dir {folder.path}")
    if not todo:
        return folder.path
    from deepinfer.speculative.config import speculation_label

    from ..sweep import parallel_fields
    with run_dir_guard(folder.path):
        env = environment()
        store = folder.open(json_text(settings), env)
        base = identity(env, "projection-" + PROJECTION_VERSION, run_id=run_id, sweep=cfg.name, model=cfg.model,
                        model_type=proj.target.arch, precision=cfg.dtype, device=cfg.device, engine="deepinfer",
                        is_projected=True, seed=cfg.seed, topology=cfg.to_dict()["topology"],
                        engine_args=dict(cfg.engine_args), range_ratio=cfg.range_ratio, launch_ranks=1,
                        projection=proj.fields())
        base["projected_on"] = base["hardware"]
        base["hardware"] = proj.hardware.name          # the GPU the row is about (charts group by it)
        for i, point in todo:
            spec = _speculative(cfg, point)
            fields = {"mode": point.mode, "isl": point.isl, "osl": point.osl, "concurrency": point.concurrency,
                      "num_prompts": point.num_prompts, "warmup": point.warmup, "gpus": point.ranks,
                      **parallel_fields(cfg, point.mode),
                      "spec_mode": "none" if spec is None else speculation_label(spec)}
            fields["expert_dispatch"] = proj.dispatch if fields["ep"] > 1 else None
            measure = (lambda p=point: decode_fields(proj, cfg, p)) if point.mode == "decode" else \
                (lambda p=point, i=i: prefill_fields(proj, cfg, p, i))
            record_point(store, base, point.key, fields, measure, on_error)
    return folder.path
