"""`deepinfer-bench report --published`: the two charts deployments are published as, from every stored sweep row.

Prefill: input tokens/s per GPU against latency (p99 TTFT, s) at `prefill_ranks` ranks (4 by default): the
"non-cached input" chart, non-cached because sweep prompts are random tokens that never hit a prefix cache.
Decode: output tokens/s per GPU against tokens/s per user at `decode_ranks` ranks (64 by default), where most
points are projected (docs/projection.md). Rows are pooled over every sweep run under the report root (or the
runs named), so measured and projected runs of one configuration share a chart.

A series (points and their Pareto frontier) per (model, hardware, engine, spec mode, measured / projected,
ISL/OSL). Measured points are filled markers on solid frontiers; projected ones open markers on dotted frontiers,
with "projected" in the legend and the calibration run and flags on hover. Each spec mode has its own marker
symbol (DSpark on and off apart at a glance); measured and projected series of one configuration share a colour.

Writes <root>/published/prefill.html/.png, decode.html/.png and points.csv (every plotted row, sorted, floats
%.6g). A chart without rows writes no file (an earlier one is removed) and says which rows it lacks and how to
get them. Same rows in, same CSV and HTML bytes out."""

from __future__ import annotations

import logging
from pathlib import Path

from deepinfer.errors import DeepInferError

from .frontier import pareto_frontier
from .report import CHARTS, _write_figure, ok_rows, sweep_runs, write_plotly_js
from .rows import CorruptRowError, atomic_write_text

log = logging.getLogger("deepinfer")

PUBLISHED_DIR = "published"
PREFILL_RANKS, DECODE_RANKS = 4, 64
SERIES_KEYS = ("model", "hardware", "engine", "spec_mode", "is_projected", "isl", "osl")
# base symbols, one per spec mode ("none" first); projected points take the "-open" form of the same symbol
SYMBOLS = ("circle", "diamond", "square", "triangle-up", "triangle-down", "pentagon", "hexagon", "star")
MEASURED_PROJECTED = ("filled markers and solid frontiers: measured; open markers and dotted frontiers: projected "
                      "(docs/projection.md)")
TITLES = {
    "prefill": ("Prefill: non-cached input throughput vs latency, {ranks} ranks",
                "input tokens/s per GPU against p99 TTFT; non-cached: random prompts, no prefix-cache hits (what the "
                "sweeps measure). "),
    "decode": ("Decode: output throughput per GPU vs per-user speed, {ranks} ranks",
               "output tokens/s per GPU against tokens/s per user (1000 / median TPOT ms). "),
}
X_TITLES = {"prefill": "latency: p99 TTFT (s)", "decode": "tokens/s per user"}
HOW_TO_GET = {
    "prefill": "a sweep with `--prefill-ranks {ranks}` on {ranks} GPUs writes them "
               "(`deepinfer-bench sweep SWEEP --prefill-ranks {ranks}`)",
    "decode": "`deepinfer-bench sweep SWEEP --decode-ranks {ranks}` writes them (projected where the ranks are "
              "not there)",
}
CSV_COLUMNS = ["mode", "series", "model", "hardware", "engine", "spec_mode", "is_projected", "isl", "osl",
               "concurrency", "gpus", "p99_ttft", "input_tput_per_gpu", "median_intvty", "output_tput_per_gpu",
               "on_frontier", "run_id", "key", "calibration", "flags"]


def considered_rows(report_root: Path, run_ids: tuple[str, ...] = ()) -> list[dict]:
    """The ok sweep rows of every run under the root, or of the runs named. A named run with a corrupt row is an
    error; any other such run is left out with one warning line."""
    runs = sweep_runs(report_root)
    missing = sorted(set(run_ids) - {d.name for d in runs})
    if missing:
        raise DeepInferError(f"no stored rows for run(s) {missing} under {report_root} (runs there: "
                             f"{[d.name for d in runs][:10]})")
    rows = []
    for run_dir in runs:
        if run_ids and run_dir.name not in run_ids:
            continue
        try:
            rows += ok_rows(run_dir)
        except CorruptRowError as e:
            if run_ids:
                raise
            log.warning(f"{e}; the published charts leave {run_dir.name} out")
    return rows


def select(rows: list[dict], mode: str, ranks: int) -> list[dict]:
    """A chart's rows: `mode` at exactly `ranks` ranks with both axes present, in a fixed order."""
    x, y = CHARTS[mode][:2]
    chosen = [r for r in rows if r.get("mode") == mode and r.get("gpus") == ranks
              and r.get(x) is not None and r.get(y) is not None]
    return sorted(chosen, key=_order)


def published_figure(rows: list[dict], mode: str, ranks: int, symbols: dict[str, str]):
    """The chart of a mode's selected rows (select()); symbols: spec mode -> base marker symbol."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative
    x, y, x_better, _, y_title = CHARTS[mode]
    fig = go.Figure()
    colours: dict[tuple, str] = {}
    for group, members in _series(rows).items():
        projected = bool(group[SERIES_KEYS.index("is_projected")])
        # measured and projected of one configuration share a colour: fill and dash tell them apart
        same = tuple(v for k, v in zip(SERIES_KEYS, group) if k != "is_projected")
        colour = colours.setdefault(same, qualitative.Plotly[len(colours) % len(qualitative.Plotly)])
        symbol = symbols[str(members[0].get("spec_mode"))] + ("-open" if projected else "")
        name = series_name(members[0])
        front = pareto_frontier(members, x, y, x_better=x_better)
        fig.add_trace(go.Scatter(
            x=[r[x] for r in members], y=[r[y] for r in members], mode="markers", name=name, legendgroup=name,
            text=[_hover(r, mode) for r in members], hoverinfo="text",
            marker={"size": 9, "symbol": symbol, "color": colour, "line": {"width": 2, "color": colour}}))
        fig.add_trace(go.Scatter(
            x=[r[x] for r in front], y=[r[y] for r in front], mode="lines", name=f"{name} frontier",
            legendgroup=name, showlegend=False, hoverinfo="skip",
            line={"dash": "dot" if projected else "solid", "color": colour, "width": 2}))
    title, subtitle = TITLES[mode]
    fig.update_layout(title={"text": title.format(ranks=ranks), "subtitle": {"text": subtitle + MEASURED_PROJECTED}},
                      xaxis_title=X_TITLES[mode], yaxis_title=y_title, template="plotly_white", width=1000,
                      height=620, margin={"t": 110}, legend={"font": {"size": 10}})
    return fig


def series_name(row: dict) -> str:
    spec = row.get("spec_mode")
    spec = "no speculation" if spec in (None, "none") else spec
    who = " / ".join(str(row.get(k)) for k in ("model", "hardware", "engine"))
    return f"{who} / {spec} {row.get('isl')}/{row.get('osl')} " + ("projected" if row.get("is_projected") else
                                                                   "measured")


def write_published(report_root: Path, prefill_ranks: int = PREFILL_RANKS, decode_ranks: int = DECODE_RANKS,
                    run_ids: tuple[str, ...] = (), png: bool = True) -> tuple[list[Path], list[str]]:
    """The published charts and points.csv under <root>/published/ -> (files written, one line per chart that had
    no rows: which rows it lacks and how to get them)."""
    report_root = Path(report_root)
    if not report_root.is_dir():
        raise DeepInferError(f"no report directory {report_root}: run a sweep first, or pass --report-dir")
    rows = considered_rows(report_root, tuple(run_ids))
    ranks = {"prefill": prefill_ranks, "decode": decode_ranks}
    chosen = {mode: select(rows, mode, ranks[mode]) for mode in CHARTS}
    out = report_root / PUBLISHED_DIR
    (out / "points.csv").unlink(missing_ok=True)     # the directory holds exactly what these rows give; a chart
    for mode in CHARTS:                              # with rows is rewritten (its PNG kept while unchanged)
        if not chosen[mode]:
            for ext in ("html", "png"):
                (out / f"{mode}.{ext}").unlink(missing_ok=True)
    symbols = spec_symbols([r for mode_rows in chosen.values() for r in mode_rows])
    written, missing, png_ok = [], [], png
    for mode, mode_rows in chosen.items():
        if not mode_rows:
            missing.append(f"published {mode} chart: no ok {mode} rows with gpus == {ranks[mode]} under "
                           f"{report_root}; " + HOW_TO_GET[mode].format(ranks=ranks[mode]))
            continue
        out.mkdir(exist_ok=True)
        fig = published_figure(mode_rows, mode, ranks[mode], symbols)
        files, png_ok = _write_figure(fig, out / mode, f"published-{mode}", png_ok, plotly_js="../plotly.min.js")
        written += files
    if written:
        written.append(write_points(out / "points.csv", chosen))
        write_plotly_js(report_root)
    return written, missing


def spec_symbols(rows: list[dict]) -> dict[str, str]:
    """Spec mode -> base marker symbol, "none" first, then sorted: the same for both charts."""
    modes = sorted({str(r.get("spec_mode")) for r in rows}, key=lambda m: (m != "none", m))
    return {m: SYMBOLS[i % len(SYMBOLS)] for i, m in enumerate(modes)}


def write_points(path: Path, chosen: dict[str, list[dict]]) -> Path:
    """points.csv: every plotted row, chart by chart in select() order, with whether it is on its frontier."""
    import pandas as pd
    lines = []
    for mode, mode_rows in chosen.items():
        x, y, x_better = CHARTS[mode][:3]
        on_front = {id(r) for members in _series(mode_rows).values()
                    for r in pareto_frontier(members, x, y, x_better=x_better)}
        for r in mode_rows:
            lines.append({c: r.get(c) for c in CSV_COLUMNS} | {
                "series": series_name(r), "is_projected": bool(r.get("is_projected")),
                "on_frontier": id(r) in on_front, "calibration": _calibration(r), "flags": "; ".join(_flags(r))})
    frame = pd.DataFrame(lines, columns=CSV_COLUMNS)
    atomic_write_text(path, frame.to_csv(index=False, float_format="%.6g", lineterminator="\n"))
    return path


def _series(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(_gpu(r.get(k)) if k == "hardware" else r.get(k) for k in SERIES_KEYS), []).append(r)
    return groups


def _gpu(name):
    """A GPU as the hardware profiles name it ("NVIDIA H200" and a projected row's "H200" alike), else as given."""
    from .projection.hardware import match
    found = match(name) if isinstance(name, str) else None
    return found.name if found is not None else name


def _order(r: dict) -> tuple:
    # None and mixed types sort as text, so any rows give one order
    text = tuple("" if r.get(k) is None else str(r.get(k)) for k in ("model", "hardware", "engine", "spec_mode"))
    return text + (bool(r.get("is_projected")), r.get("isl") or 0, r.get("osl") or 0, r.get("concurrency") or 0,
                   str(r.get("run_id")), str(r.get("key")))


def _calibration(r: dict) -> str:
    """The runs a projected row was calibrated on: its projection's `calibration` ({role: {"run": id,
    "measured_on": GPU, ...} or None}) as "decode step-... (GPU)"; other `calibration*` fields as key=value."""
    projection = r.get("projection") if isinstance(r.get("projection"), dict) else {}
    found = {k: v for source in (r, projection) for k, v in source.items() if k.startswith("calibration")}
    parts = []
    for key, value in sorted(found.items()):
        if not isinstance(value, dict):
            parts.append(f"{key}={value}")
            continue
        for role, cal in sorted(value.items()):
            if isinstance(cal, dict):
                on = f" ({cal['measured_on']})" if cal.get("measured_on") else ""
                parts.append(f"{role} {cal.get('run')}{on}")
            elif cal is not None:
                parts.append(f"{role} {cal}")
    return "; ".join(parts)


def _flags(r: dict) -> list[str]:
    flags = r.get("flags")
    return [str(f) for f in flags] if isinstance(flags, (list, tuple)) else []


def _hover(r: dict, mode: str) -> str:
    x, y, _, x_title, y_title = CHARTS[mode]
    fields = [("point", r.get("key")), ("run", r.get("run_id")), ("model", r.get("model")),
              ("hardware", r.get("hardware")), ("spec", r.get("spec_mode")), ("gpus", r.get("gpus")),
              ("concurrency", r.get("concurrency")), (x_title, r.get(x)), (y_title, r.get(y))]
    if r.get("is_projected"):
        fields += [("projected from", _calibration(r) or "not recorded")]
        fields += [("flag", f) for f in _flags(r)]
    return "<br>".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in fields)
