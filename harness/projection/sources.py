"""What a projected sweep is built from: the model it projects (its released shape), the calibration runs of that
model found under the report directory (the rank view's decode rows, the step bench's prefill rows), the hardware
profiles and the dispatch / combine series of its backend (docs/projection.md, "The projected sweep")."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from deepinfer.errors import DeepInferError

from . import comm as comm_data
from .calibration import Calibration, busy_ms, run_settings
from .comm import AlphaBeta
from .hardware import Profile
from .hardware import match as hw_match

# hub ids of the released checkpoints -> (arch, preset): their shapes are the presets' at full depth
RELEASED = {"deepseek-ai/DeepSeek-V4.1-Flash-1017": ("deepseek_v41", "flash"),
            "deepseek-ai/DeepSeek-V4-Flash": ("deepseek_v4", "flash")}
# the engine's expert_dispatch -> the published series the projection times it with, per phase. The engine's
# default (allgather) has no published series at scale: a projected deployment exchanges with DeepEP, as DeepSeek's
# does, and the rows say so.
PROJECTED_DISPATCH = {"deepep": {"decode": "deepep_ll", "prefill": "deepep_normal"},
                      "alltoall": {"decode": "torch_all_to_all", "prefill": "torch_all_to_all"}}
DEFAULT_DISPATCH = "deepep"


@dataclass(frozen=True)
class Target:
    """The model a projection is for: its family, preset and the config at the depth projected."""
    arch: str
    preset: str
    cfg: object

    @property
    def drafter(self) -> str:
        """The draft method its family speculates with (DSpark for V4.1, MTP for V4)."""
        from deepinfer.config import CONFIG_CLASSES
        return CONFIG_CLASSES[self.arch].DRAFT_METHOD


def target_model(spec: str) -> Target:
    """random:ARCH:PRESET:N (N layers deep) or a released checkpoint's hub id (its full depth)."""
    from deepinfer.config.presets import preset_config
    from deepinfer.validate import parse_random_spec
    if spec in RELEASED:
        arch, preset = RELEASED[spec]
        return Target(arch, preset, preset_config(arch, preset))
    if isinstance(spec, str) and spec.startswith("random:"):
        r = parse_random_spec(spec)
        return Target(r.arch, r.preset, preset_config(r.arch, r.preset, r.layers))
    raise DeepInferError(f"model {spec!r}: a projection needs the model's shape without its weights; use "
                         f"random:ARCH:PRESET:LAYERS or a released id ({', '.join(RELEASED)})")


def projectable(spec: str) -> bool:
    """Whether the projection knows the model's shape and family (a flash-width random model or a released id)."""
    try:
        return target_model(spec).preset == "flash"
    except DeepInferError:
        return False


CALIBRATION_DIR = "reports"      # the committed rows, looked in after the sweep's own report directory


def _runs(report_dir: Path) -> list[Path]:
    """Every run folder under the report directory and ./reports (where the committed calibration rows live)."""
    roots = dict.fromkeys(Path(d).resolve() for d in (report_dir, CALIBRATION_DIR) if Path(d).is_dir())
    return [p.parent for root in roots for p in sorted(root.glob("*/*/rows.jsonl"))]


def _step_rows(run: Path) -> list[dict]:
    rows = []
    for line in (run / "rows.jsonl").read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue                     # a torn or corrupt line: that run is read by its own tools
        if row.get("bench") == "step" and row.get("status", "ok") == "ok":
            rows.append(row)
    return rows


def _family(row: dict) -> tuple[str, str] | None:
    """(arch, preset) of the model a step row measured: a random spec's, or a released checkpoint's."""
    spec = row.get("model", "")
    if spec in RELEASED:
        return RELEASED[spec]
    parts = spec.split(":") if isinstance(spec, str) else []
    return (parts[1], parts[2]) if len(parts) >= 4 and parts[0] == "random" else None


def _decode_preference(rows: list[dict]) -> tuple:
    """Best decode calibration first: graphed steps, then more rank-view points, then the newest."""
    return (all(r.get("graphed") for r in rows), len(rows), max(r.get("started", "") for r in rows))


def _prefill_preference(rows: list[dict]) -> tuple:
    """Best prefill calibration first: the fast kernels (not the reference backend), then the newest."""
    return (all(r.get("kernel_backend") not in (None, "reference") for r in rows),
            max(r.get("started", "") for r in rows))


def decode_calibration(report_dir, target: Target, run: str | None = None) -> Calibration:
    """The rank-view run that calibrates decode (`run`: its id; None: the best one of this model family)."""
    folder = _pick(report_dir, target, run, lambda rows: [r for r in rows if r.get("ep_size") and
                                                          r.get("query_len") == 1], "decode", _decode_preference,
                   "deepinfer-bench step --model random:{arch}:{preset}:4 --batch 1,16,64,256 --context 1024 "
                   "--ep 1,2,8,64 --rank 0")
    return Calibration.from_run(folder)


@dataclass(frozen=True)
class PrefillPoint:
    tokens: int
    busy_ms: float


@dataclass(frozen=True)
class PrefillCalibration:
    """A step run's prefill points (one row of T tokens from an empty state, the whole model on one GPU)."""
    model: str
    hardware: str
    layers: int
    run: str
    started: str
    points: tuple[PrefillPoint, ...]
    settings: dict = field(default_factory=dict)    # the numerics it ran: expert_storage, precision


def prefill_calibration(report_dir, target: Target, run: str | None = None) -> PrefillCalibration:
    """The prefill points (rows `prefill-t<T>` of step runs) that calibrate prefill: those of run `run`, or those of
    every run of this family on the best run's GPU and kernel class (the newest row of each T wins)."""
    select = lambda rows: [r for r in rows if str(r.get("key", "")).startswith("prefill-")]   # noqa: E731
    best = _pick(report_dir, target, run, select, "prefill", _prefill_preference,
                 "deepinfer-bench step --model random:{arch}:{preset}:4 --prefill 2048,8192")
    first = select(_step_rows(best))[0]
    rows = []
    for folder in ([best] if run is not None else _runs(report_dir)):
        mine = select(_step_rows(folder))
        if mine and _family(mine[0]) == _family(first) and mine[0]["hardware"] == first["hardware"] \
                and _prefill_preference(mine)[0] == _prefill_preference([first])[0] and mine[0]["layers"] == first["layers"]:
            rows += [{**r, "run_id": folder.name} for r in mine]       # the folder names the run in reports/
    points, runs = {}, {}
    for r in sorted(rows, key=lambda r: r.get("started", "")):      # the newest row of each T wins
        points[r["query_len"]] = PrefillPoint(r["query_len"], busy_ms(r))
        runs[r["query_len"]] = r["run_id"]
    return PrefillCalibration(first["model"], first["hardware"], first["layers"],
                              "+".join(sorted(set(runs.values()))), max(r["started"] for r in rows),
                              tuple(points[t] for t in sorted(points)), run_settings(first))


def _pick(report_dir, target: Target, run, select, what: str, rank, how: str) -> Path:
    family = (target.arch, target.preset)
    found = []
    for folder in _runs(report_dir):
        if run is not None and folder.name != run:
            continue
        rows = select(_step_rows(folder))
        if rows and _family(rows[0]) == family:
            found.append((folder, rows))
    if not found:
        which = f"run {run!r}" if run is not None else f"run under {report_dir} or ./{CALIBRATION_DIR}"
        raise DeepInferError(f"no {what} calibration of {target.arch}/{target.preset}: no {which} has its step rows; "
                             f"measure them with `{how.format(arch=target.arch, preset=target.preset)}` "
                             f"(docs/projection.md)")
    return max(found, key=lambda fr: rank(fr[1]))[0]


def comm_series(backend: str, target: Profile, ep: int, path=None) -> tuple[dict[str, AlphaBeta], list[str]]:
    """op -> the fitted series of `backend` on the link an EP-`ep` group of `target` GPUs exchanges over, and the
    flags of what stood in: a missing op takes the other op's fit (its alpha and bandwidth, at its own message
    size); a series measured on other hardware has its bandwidth scaled by the target's link rate over its own."""
    link = target.link(ep)
    fits = comm_data.fit(comm_data.load(path)["series"])
    have = {op: fits[(backend, link, op)] for op in ("dispatch", "combine") if (backend, link, op) in fits}
    if not have:
        known = sorted({f"{b}/{lk}" for b, lk, _ in fits})
        raise DeepInferError(f"no published {backend} series over {link} in the comm data (it has {known}); add one "
                             f"to harness/projection/data/comm.json")
    flags = []
    for op in ("dispatch", "combine"):
        if op not in have:
            other = next(iter(have))
            have[op] = have[other]
            flags.append(f"{op}: {backend}/{link} {other}'s fit (no {op} series published)")
    rate = "nvlink_bytes_per_s" if link == "nvlink" else "scaleout_bytes_per_s"
    for op, ab in have.items():
        source = hw_match(ab.measured_on)
        if source is None or source.name == target.name:
            continue
        ratio = getattr(target, rate) / getattr(source, rate)
        flags.append(f"{op}: measured on {ab.measured_on}; bandwidth x{ratio:.3g} for the {target.name}'s {link}")
        if ratio != 1:
            have[op] = replace(ab, beta={e: b * ratio for e, b in ab.beta.items()})
    return have, flags
