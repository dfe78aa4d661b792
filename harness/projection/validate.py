"""`deepinfer-bench projection validate`: the EP decode projection against published large-EP deployments on their own
configurations (the op-level model, opmodel.py) and against our own measured steps (the calibration's interpolation,
each interior batch predicted from the others), one row each with its error, whether it is within the bound (15%
published, 10% own), and for every miss its cause: derived from the model's terms, plus what the anchor file
states of the deployment. Writes the table to <report dir>/projection/validation.md and .csv (docs/projection.md,
"Validation")."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from deepinfer.errors import DeepInferError

from . import comm as comm_data
from . import hardware
from .calibration import Calibration
from .kernel_rates import kernels
from .opmodel import SHAPES, Deployment, OpStep, project_ops

ANCHORS_FILE = "anchors.json"
OUT_DIR = "projection"
CSV_FIELDS = ("anchor", "kind", "gpu", "ep", "batch", "context", "tokens_per_step", "published_tok_s_per_gpu",
              "projected_tok_s_per_gpu", "error", "bound", "within", "serial_tok_s_per_gpu",
              "full_overlap_tok_s_per_gpu", "implied_share", "overlap_share", "step_ms", "compute_ms", "comm_ms",
              "cause")


@dataclass(frozen=True)
class Row:
    anchor: str
    kind: str                        # "published" | "own"
    gpu: str
    ep: int | None
    batch: float | None              # sequences per GPU
    context: float | None
    tokens_per_step: float | None
    published_tok_s_per_gpu: float   # own rows: the measured step's
    projected_tok_s_per_gpu: float | None     # None: not reproducible
    error: float | None              # projected / published - 1
    bound: float
    within: bool | None
    serial_tok_s_per_gpu: float | None = None   # published rows: the same step with no overlap
    full_overlap_tok_s_per_gpu: float | None = None   # published rows: the exchange hidden as far as it can be
    implied_share: float | None = None          # published rows: the share of the hideable exchange the figure implies
    overlap_share: float | None = None          # published rows: the share projected (the other anchors' mean)
    step_ms: float | None = None
    compute_ms: float | None = None
    comm_ms: float | None = None
    cause: str = ""                  # empty only when within the bound

    def csv_row(self) -> dict:
        out = {}
        for f in CSV_FIELDS:
            v = getattr(self, f)
            out[f] = "" if v is None else (f"{v:.4f}" if isinstance(v, float) else v)
        return out


# ---- the data ----
def _read(path, name: str) -> str:
    if path is None:
        return (resources.files(__package__) / "data" / name).read_text()
    return Path(_existing(path, name, "--anchors-file")).read_text()


def load_anchors(path=None) -> dict:
    """anchors.json (versioned): kernel_rates, published and own anchors; one line naming what is missing."""
    data = json.loads(_read(path, ANCHORS_FILE))
    missing = [k for k in ("version", "bounds", "kernel_rates", "published", "own") if k not in data]
    if missing:
        raise DeepInferError(f"{ANCHORS_FILE}: lacks {missing}")
    for a in data["published"]:
        need = {"id", "model", "gpu", "published", "source"}
        if "not_reproducible" not in a:
            need |= {"ep", "batch", "context", "kv_cache", "query_tokens", "draft_layers", "tokens_per_step"}
        lacks = sorted(need - set(a))
        if lacks:
            raise DeepInferError(f"{ANCHORS_FILE}: published anchor {a.get('id', '?')} lacks {lacks}")
    for a in data["own"]:
        lacks = sorted({"id", "run", "ep", "gpus"} - set(a))
        if lacks:
            raise DeepInferError(f"{ANCHORS_FILE}: own anchor {a.get('id', '?')} lacks {lacks}")
    return data


def per_gpu(published: dict) -> float:
    """The published figure as output tok/s per GPU: per node / GPUs per node, a total's output share."""
    return published["value"] / published["gpus"] * published.get("output_share", 1.0)


# ---- published deployments: the op model on their configurations ----
def published_row(a: dict, bound: float, profiles, rates, fits) -> Row:
    pub = per_gpu(a["published"])
    if "not_reproducible" in a:
        return Row(a["id"], "published", a["gpu"], None, None, None, None, pub, None, None, bound, None,
                   cause=f"not reproducible: {a['not_reproducible']}")
    if a["model"] not in SHAPES:
        raise DeepInferError(f"{ANCHORS_FILE}: anchor {a['id']}: no op-level shape {a['model']!r} (have "
                             f"{sorted(SHAPES)})")
    if a["gpu"] not in profiles:
        raise DeepInferError(f"{ANCHORS_FILE}: anchor {a['id']}: no hardware profile {a['gpu']!r}")
    dep = Deployment(a["gpu"], a["ep"], a["batch"], a["context"], a.get("redundant_experts", 0), a["kv_cache"],
                     a["query_tokens"], a["draft_layers"], a["tokens_per_step"],
                     overlap=a.get("overlap", "two_micro_batches"))
    got = project_ops(SHAPES[a["model"]], dep, profiles[a["gpu"]], profiles, rates, fits)
    err = got.output_tok_s_per_gpu / pub - 1
    within = abs(err) <= bound
    cause = "" if within else _published_cause(a, dep, got, pub, err)
    return Row(a["id"], "published", a["gpu"], a["ep"], a["batch"], a["context"], a["tokens_per_step"], pub,
               got.output_tok_s_per_gpu, err, bound, within, got.serial_tok_s_per_gpu, got.output_tok_s_per_gpu,
               step_ms=got.step_ms, compute_ms=got.compute_ms, comm_ms=got.comm_ms, cause=cause)


# ---- the overlap a deployment achieves: fitted on the others, checked on each ----
def _step_ms(r: Row, tok_s_per_gpu: float) -> float:
    return r.batch * r.tokens_per_step / tok_s_per_gpu * 1e3


def implied_share(r: Row) -> float:
    """The share of the hideable exchange (serial step - fully overlapped step) the published figure implies,
    clipped to [0, 1]."""
    serial, full = _step_ms(r, r.serial_tok_s_per_gpu), _step_ms(r, r.full_overlap_tok_s_per_gpu)
    share = (serial - _step_ms(r, r.published_tok_s_per_gpu)) / (serial - full) if serial > full else 1.0
    return min(max(share, 0.0), 1.0)


def leave_one_out(rows: list[Row], anchors: dict) -> list[Row]:
    """Published rows projected with the overlap share the *other* reproducible anchors imply (their mean): the
    overlap is fitted to deployments, and each is predicted by a fit it took no part in. Other rows unchanged."""
    fitted = {r.anchor: implied_share(r) for r in rows if r.kind == "published" and r.within is not None}
    gaps = {a["id"]: a.get("known_gaps", "") for a in anchors["published"]}
    out = []
    for r in rows:
        if r.anchor not in fitted or len(fitted) < 2:
            out.append(r)
            continue
        others = [v for k, v in fitted.items() if k != r.anchor]
        share = sum(others) / len(others)
        serial, full = _step_ms(r, r.serial_tok_s_per_gpu), _step_ms(r, r.full_overlap_tok_s_per_gpu)
        step = serial - share * (serial - full)
        projected = r.batch * r.tokens_per_step / step * 1e3
        err = projected / r.published_tok_s_per_gpu - 1
        within = abs(err) <= r.bound
        cause = "" if within else (
            f"{'over' if err > 0 else 'under'} by {err:+.0%}: compute {r.compute_ms:.1f} ms, comm {r.comm_ms:.1f} ms "
            f"a step; the other anchors hide {share:.0%} of the hideable exchange, this one's figure implies "
            f"{fitted[r.anchor]:.0%} (fully overlapped: {r.full_overlap_tok_s_per_gpu:.0f} tok/s/GPU, serial: "
            f"{r.serial_tok_s_per_gpu:.0f})" + (f"; the anchor: {gaps[r.anchor]}" if gaps.get(r.anchor) else ""))
        out.append(replace(r, projected_tok_s_per_gpu=projected, error=err, within=within, step_ms=step,
                           implied_share=fitted[r.anchor], overlap_share=share, cause=cause))
    return out


def fitted_overlap(anchors_file=None, hardware_file=None, comm_file=None) -> tuple[float, float]:
    """(the overlap share every reproducible published anchor implies, on average; the largest leave-one-out error
    of the published anchors): what projections of V4 / V4.1 use and label their figures with."""
    anchors = load_anchors(anchors_file)
    profiles = hardware.profiles(_existing(hardware_file, "hardware file", "--hardware-file"))
    fits = comm_data.fit(comm_data.load(_existing(comm_file, "comm file", "--comm-file"))["series"])
    rows = [published_row(a, anchors["bounds"]["published"], profiles, kernels(anchors["kernel_rates"]), fits)
            for a in anchors["published"]]
    shares = [implied_share(r) for r in rows if r.within is not None]
    band = max(abs(r.error) for r in leave_one_out(rows, anchors) if r.within is not None)
    return sum(shares) / len(shares), band


def _published_cause(a: dict, dep: Deployment, got: OpStep, pub: float, err: float) -> str:
    """Why the projection misses a published figure, from its terms: where the published step sits between the
    fully overlapped step and the serial one, and what the anchor states of the deployment."""
    step_pub = dep.batch * dep.tokens_per_step / pub * 1e3          # ms: the step the published figure implies
    side = "comm" if got.comm_ms >= got.compute_ms else "compute"
    terms = f"compute {got.compute_ms:.1f} ms, comm {got.comm_ms:.1f} ms a step ({side}-bound)"
    if err > 0 and step_pub <= got.serial_step_ms:
        hidden = (got.serial_step_ms - step_pub) / min(got.compute_ms, got.comm_ms)
        why = (f"over by {err:+.0%}: {terms}; the published step ({step_pub:.1f} ms) lies between the fully "
               f"overlapped one ({got.step_ms:.1f} ms) and the serial one ({got.serial_step_ms:.1f} ms, "
               f"{got.serial_tok_s_per_gpu:.0f} tok/s/GPU): the deployment hides {hidden:.0%} of the smaller side "
               f"under the larger, the two-micro-batch formula all of it")
    elif err > 0:
        why = (f"over by {err:+.0%} even with no overlap ({got.serial_tok_s_per_gpu:.0f} tok/s/GPU): the published "
               f"step ({step_pub:.1f} ms) is longer than compute + comm ({got.serial_step_ms:.1f} ms; {terms})")
    else:
        top = max(got.op_ms, key=got.op_ms.get)
        why = (f"under by {err:+.0%}: the model's step ({got.step_ms:.1f} ms; {terms}; largest op {top} "
               f"{got.op_ms[top]:.1f} ms) is longer than the published one ({step_pub:.1f} ms)")
    return f"{why}; the anchor: {a['known_gaps']}" if a.get("known_gaps") else why


# ---- our own measured steps: leave one batch out ----
def own_rows(a: dict, bound: float, report_dir: Path) -> list[Row]:
    """Each interior batch of each (EP, context) of the run, predicted by the calibration's interpolation from the
    run's other points; the batches at the ends have no neighbours on one side and are not predicted."""
    cal = Calibration.from_run(report_dir / "1" / a["run"])
    known = hardware.match(cal.hardware)
    gpu = known.name if known else cal.hardware
    rows = []
    for p in sorted(cal.points, key=lambda p: (p.ep, p.context, p.batch)):
        if p.ep not in a["ep"]:
            continue
        batches = sorted(q.batch for q in cal.points if q.ep == p.ep and q.context == p.context)
        if p.batch in (batches[0], batches[-1]):
            continue
        rest = replace(cal, points=[q for q in cal.points if q is not p])
        pred = rest.lookup(p.ep, p.batch, p.context).busy_ms
        measured, projected = p.batch / p.busy_ms * 1e3, p.batch / pred * 1e3
        err = projected / measured - 1
        within = abs(err) <= bound
        cause = ""
        if not within:
            lo = max(b for b in batches if b < p.batch)
            hi = min(b for b in batches if b > p.batch)
            way = "under" if pred < p.busy_ms else "over"
            grow = [q for q in rest.points if q.ep == p.ep and q.context == p.context and q.batch in (lo, hi)]
            b_lo, b_hi = sorted(grow, key=lambda q: q.batch)
            rate = [q.total_bytes / q.busy_ms / 1e9 for q in (b_lo, p, b_hi)]      # TB/s: bytes per ms / 1e9
            cause = (f"interpolation in roofline bytes between the measured batches {lo} and {hi} ({hi / lo:g}x apart) "
                     f"{way}-predicts the step at batch {p.batch}: measured {p.busy_ms:.2f} ms, interpolated "
                     f"{pred:.2f} ms; the step is not linear in its bytes over that span (it reads {rate[0]:.2f}, "
                     f"{rate[1]:.2f} and {rate[2]:.2f} TB/s at batch {lo}, {p.batch} and {hi}: launch, compute or "
                     f"kernel efficiency change with the batch), so a grid of every power of two would bracket it")
            if p.eager:
                cause += "; eager rows: busy time = median x (1 - GPU idle fraction) of a 5-step trace"
        rows.append(Row(f"{a['id']} ep{p.ep} b{p.batch} c{p.context}", "own", gpu, p.ep, p.batch,
                        p.context, 1.0, measured, projected, err, bound, within, step_ms=pred, cause=cause))
    return rows


# ---- the run ----
def run_validation(report_dir, hardware_file=None, comm_file=None, anchors_file=None) -> tuple[list[Row], str]:
    """Every anchor's row and the provenance line (the data versions and the runs read)."""
    report_dir = Path(report_dir)
    anchors = load_anchors(anchors_file)
    profiles = hardware.profiles(_existing(hardware_file, "hardware file", "--hardware-file"))
    comm = comm_data.load(_existing(comm_file, "comm file", "--comm-file"))
    fits = comm_data.fit(comm["series"])
    rates = kernels(anchors["kernel_rates"])
    bounds = anchors["bounds"]
    rows = leave_one_out([published_row(a, bounds["published"], profiles, rates, fits)
                          for a in anchors["published"]], anchors)
    for a in anchors["own"]:
        rows += own_rows(a, bounds["own"], report_dir)
    hw_version = next(iter(profiles.values())).version
    runs = ", ".join(f"{report_dir.name}/1/{a['run']}" for a in anchors["own"])
    provenance = (f"data: {ANCHORS_FILE} v{anchors['version']}, hardware.json v{hw_version}, comm.json "
                  f"v{comm['version']}; own points: {runs}")
    return rows, provenance


def _existing(path, what: str, option: str):
    if path is not None and not Path(path).is_file():
        raise DeepInferError(f"no {what} at {path}: give an existing file, or leave {option} out for the packaged one")
    return path


def validate(report_dir, hardware_file=None, comm_file=None, anchors_file=None) -> tuple[list[Row], list[Path]]:
    """Run every anchor and write <report_dir>/projection/validation.md and .csv; the rows and the files."""
    rows, provenance = run_validation(report_dir, hardware_file, comm_file, anchors_file)
    return rows, write_table(rows, provenance, Path(report_dir) / OUT_DIR)


# ---- the table ----
def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def verdict(r: Row) -> str:
    return "not reproducible" if r.within is None else ("within" if r.within else "miss")


def table_lines(rows: list[Row]) -> list[str]:
    """The table as the command prints it: one line per anchor (causes in the written files)."""
    lines = [f"{'anchor':<44} {'published':>9} {'projected':>9} {'error':>7} {'bound':>5}  verdict"]
    for r in rows:
        lines.append(f"{r.anchor:<44} {r.published_tok_s_per_gpu:>9.0f} {_fmt(r.projected_tok_s_per_gpu, '9.0f'):>9} "
                     f"{_fmt(r.error, '+7.1%'):>7} {r.bound:>5.0%}  {verdict(r)}")
    return lines


def markdown(rows: list[Row], provenance: str) -> str:
    out = ["# Projection validation (docs/projection.md, \"Validation\")", "",
           "Output tok/s per GPU: published (own rows: measured) against projected. Published rows: the op-level "
           "model (harness/projection/opmodel.py) on the deployment's own configuration, two micro-batches hiding the "
           "share of the hideable exchange that the *other* published anchors imply (leave one out: `share`; "
           "`implied` is what this anchor's own figure implies); `full` hides all of it, `serial` none. Own rows: "
           "the calibration's interpolation at a batch left out of it. Regenerate: `deepinfer-bench projection "
           "validate`.", "", provenance, "",
           "| anchor | GPU | EP | batch | context | tok/step | published | projected | error | bound | verdict | "
           "full | serial | implied | share | step ms | compute ms | comm ms |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | "
           "---: | ---: | ---: |"]
    for r in rows:
        out.append(f"| {r.anchor} | {r.gpu} | {_fmt(r.ep, 'd')} | {_fmt(r.batch, 'g')} | {_fmt(r.context, 'g')} | "
                   f"{_fmt(r.tokens_per_step, 'g')} | {r.published_tok_s_per_gpu:.0f} | "
                   f"{_fmt(r.projected_tok_s_per_gpu, '.0f')} | {_fmt(r.error, '+.1%')} | {r.bound:.0%} | "
                   f"{verdict(r)} | {_fmt(r.full_overlap_tok_s_per_gpu, '.0f')} | "
                   f"{_fmt(r.serial_tok_s_per_gpu, '.0f')} | {_fmt(r.implied_share, '.0%')} | "
                   f"{_fmt(r.overlap_share, '.0%')} | {_fmt(r.step_ms, '.1f')} | "
                   f"{_fmt(r.compute_ms, '.1f')} | {_fmt(r.comm_ms, '.1f')} |")
    out += ["", "## Causes", ""]
    out += [f"- **{r.anchor}**: {r.cause}" for r in rows if r.cause]
    return "\n".join(out) + "\n"


def write_table(rows: list[Row], provenance: str, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / "validation.md"
    md.write_text(markdown(rows, provenance))
    buf = io.StringIO()
    buf.write(f"# {provenance}\n")
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(r.csv_row() for r in rows)
    path = out_dir / "validation.csv"
    path.write_text(buf.getvalue())
    return [md, path]
