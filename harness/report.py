"""`deepinfer-bench report`: every table and chart of a run, regenerated from its stored rows alone.

Per run directory: `summary.csv` (pandas; one line per successful point, fixed column order, stable float
format; the last four columns are the point's expert traffic, harness/traffic.py), `prefill_pareto.html/.png`
(input tok/s/GPU against p99 TTFT) and `decode_pareto.html/.png` (output tok/s/GPU against tok/s/user = 1000 /
median TPOT), with the Pareto frontier drawn per (hardware, engine, spec mode, measured/projected) group and
every point's details on hover. `reports/index.md` lists the runs with their routing verdict (balanced, N of M
rows unbalanced, not recorded); only `deepinfer-bench report` writes it (the publish step: sweeps and evals
leave it alone), and a run whose rows cannot be read is listed as unreadable with one warning line, so one
corrupt run never stops the others.

Charts are plotly figures written as HTML (plotly.js once for all runs, `<report root>/plotly.min.js`, so
the pages work offline) and PNG through kaleido. Kaleido drives a Chrome / Chromium: it uses the browser at
$BROWSER_PATH, else one installed in the usual places, else the one `plotly_get_chrome` downloads. Without
one, PNGs are skipped with one warning line naming those options; HTML and CSV are written regardless, and a PNG
already there is kept while its chart's HTML comes out byte for byte the same (`--no-png` likewise).
Same rows in, same CSV and HTML bytes out (fixed div ids, sorted rows, no timestamps); chart files of a mode
without rows are removed. Reading never changes the rows."""

from __future__ import annotations

import logging
from pathlib import Path

from .frontier import DEFAULT_GROUP_KEYS, frontiers
from deepinfer.errors import DeepInferError

from .rows import CorruptRowError, atomic_write_bytes, atomic_write_text, read_rows
from .traffic import TRAFFIC_COLUMNS, routing_verdict, traffic_cell, traffic_columns

log = logging.getLogger("deepinfer")

COLUMNS = ["run_id", "key", "mode", "isl", "osl", "concurrency", "num_prompts", "gpus", "hardware", "engine",
           "spec_mode", "is_projected", "model", "precision", "completed", "failed", "duration",
           "input_tput_per_gpu", "output_tput_per_gpu", "tput_per_gpu", "median_intvty",
           "mean_ttft", "median_ttft", "p90_ttft", "p99_ttft", "mean_tpot", "median_tpot", "p90_tpot", "p99_tpot",
           "mean_itl", "median_itl", "p90_itl", "p99_itl", "mean_e2el", "median_e2el", "p90_e2el", "p99_e2el",
           "shared_prefix", "turns", "prefix_hit_rate", "prefix_ideal_rate", "prefill_tokens_computed",
           "host_ms", "device_wait_ms", *TRAFFIC_COLUMNS]
CHARTS = {
    "prefill": ("p99_ttft", "input_tput_per_gpu", "lower", "p99 TTFT (s)", "input tokens/s per GPU"),
    "decode": ("median_intvty", "output_tput_per_gpu", "higher", "tokens/s per user (1000 / median TPOT ms)",
               "output tokens/s per GPU"),
}
CHART_GROUP_KEYS = (*DEFAULT_GROUP_KEYS, "isl", "osl")   # one frontier per group and scenario (ISL/OSL)
PNG_HELP = ("set BROWSER_PATH to a Chrome/Chromium binary (e.g. apt install chromium) or run plotly_get_chrome; "
            "HTML and CSV are written without it")


def ok_rows(run_dir: Path) -> list[dict]:
    rows = [r for r in read_rows(run_dir) if r.get("status") == "ok" and r.get("mode") in CHARTS]
    return sorted(rows, key=lambda r: (r["mode"] != "prefill", r["isl"], r["osl"], r["concurrency"], r["key"]))


def write_summary(run_dir: Path, rows: list[dict]) -> Path:
    import pandas as pd
    frame = pd.DataFrame([{c: r.get(c) for c in COLUMNS} | traffic_columns(r) for r in rows], columns=COLUMNS)
    path = run_dir / "summary.csv"
    atomic_write_text(path, frame.to_csv(index=False, float_format="%.6g", lineterminator="\n"))
    return path


def pareto_figure(rows: list[dict], mode: str, title: str, by_run: bool = False):
    """One chart of a mode's points and frontiers, a series per group (CHART_GROUP_KEYS; by_run: per run too)."""
    import plotly.graph_objects as go
    x, y, x_better, x_title, y_title = CHARTS[mode]
    points = [r for r in rows if r["mode"] == mode and r.get(x) is not None and r.get(y) is not None]
    fig = go.Figure()
    keys = (("run_id",) if by_run else ()) + tuple(CHART_GROUP_KEYS)
    for group, front in frontiers(points, keys, x, y, x_better=x_better).items():
        members = [r for r in points if tuple(r.get(k) for k in keys) == group]
        *who, projected, isl, osl = group
        name = " / ".join(str(g) for g in who if g is not None) + f" {isl}/{osl}" + (" projected" if projected else "")
        dash = "dot" if projected else "solid"                      # projected groups dotted
        fig.add_trace(go.Scatter(
            x=[r[x] for r in members], y=[r[y] for r in members], mode="markers", name=f"{name} points",
            text=[_hover(r) for r in members], hoverinfo="text", marker={"size": 8}))
        fig.add_trace(go.Scatter(x=[r[x] for r in front], y=[r[y] for r in front], mode="lines",
                                 name=f"{name} frontier", line={"dash": dash}, hoverinfo="skip"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title=y_title, template="plotly_white",
                      width=900, height=560)
    return fig


def _write_figure(fig, stem: Path, div_id: str, png: bool, plotly_js: str = "../../plotly.min.js"
                  ) -> tuple[list[Path], bool]:
    """stem.html (plotly.js from reports/plotly.min.js: `plotly_js` is that file relative to stem's directory, a
    run directory by default) and, when png, stem.png -> (written, png still on: False once kaleido could not start
    a browser, with one warning). Without a PNG written (png off, or no browser), an existing stem.png stays only
    while its figure is unchanged, i.e. the new HTML is byte for byte the old one (same rows give the same HTML):
    a machine without Chrome keeps the charts another machine rendered, and never a chart of other rows."""
    html, image = stem.parent / f"{stem.name}.html", stem.parent / f"{stem.name}.png"   # a run id may hold dots
    page = fig.to_html(include_plotlyjs=plotly_js, full_html=True, div_id=div_id, config={"displaylogo": False})
    if not (html.exists() and html.read_text() == page):
        image.unlink(missing_ok=True)      # a picture of other rows goes before the new chart lands
    atomic_write_text(html, page)
    written = [html]
    if png:
        try:
            data = fig.to_image(format="png", scale=2)
        except Exception as e:     # noqa: BLE001  kaleido raises RuntimeError / ValueError / OSError kinds
            log.warning(f"PNG charts skipped: kaleido could not start a browser ({type(e).__name__}); {PNG_HELP}")
            png = False
        else:
            atomic_write_bytes(image, data)
    if image.exists():                     # written now, or kept: its chart is unchanged
        written.append(image)
    return written, png


def write_charts(run_dir: Path, rows: list[dict], png: bool = True) -> list[Path]:
    written, png_ok = [], png
    run_id = run_dir.name
    for mode in CHARTS:
        if not any(r["mode"] == mode for r in rows):
            for stale in run_dir.glob(f"{mode}_pareto.*"):     # the directory holds exactly what these rows give
                stale.unlink()
            continue
        fig = pareto_figure(rows, mode, f"{run_id}: {mode} Pareto")
        files, png_ok = _write_figure(fig, run_dir / f"{mode}_pareto", f"{mode}-pareto", png_ok)
        written += files
    if written:
        write_plotly_js(run_dir.parent.parent)
    return written


def write_plotly_js(report_root: Path) -> None:
    """<root>/plotly.min.js, when missing: one copy for every chart under the root."""
    root_js = report_root / "plotly.min.js"
    if not root_js.exists():
        import plotly
        atomic_write_text(root_js, (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text())


EVAL_DIR = "eval"            # deepinfer-eval's runs: <root>/eval/<run_id>/


def sweep_runs(report_root: Path) -> list[Path]:
    """Every sweep / check run: <root>/<schema_version>/<run_id>/ holding rows.jsonl."""
    return sorted(p.parent for p in report_root.glob("*/*/rows.jsonl") if p.parent.parent.name != EVAL_DIR)


def readable_rows(run_dir: Path) -> tuple[list[dict], str]:
    """(the run's rows, "") or, when a row is corrupt, ([], " (unreadable: rows.jsonl:N is not a JSON row)") and
    one warning line."""
    try:
        return read_rows(run_dir), ""
    except CorruptRowError as e:
        log.warning(f"{e}; the index lists {run_dir.name} as unreadable")
        return [], f" (unreadable: {e.short})"


def write_index(report_root: Path) -> Path:
    """reports/index.md: every sweep run under <root>/<schema_version>/<run_id>/ with its points and charts, and
    every eval run under <root>/eval/<run_id>/ with its tasks and thresholds; a run with a corrupt row is listed
    as unreadable (one warning line), not an error."""
    if not report_root.is_dir():
        raise DeepInferError(f"no report directory {report_root}: run a sweep first, or pass --report-dir")
    lines = ["# Benchmark runs", "", "Regenerate with `deepinfer-bench report --all`.", "",
             "| run | schema | points (ok / failed) | routing | charts |", "| --- | --- | --- | --- | --- |"]
    lines += [_sweep_line(report_root, run_dir) for run_dir in sweep_runs(report_root)]
    evals = sorted(p.parent for p in (report_root / EVAL_DIR).glob("*/rows.jsonl"))
    if evals:
        lines += ["", "## Eval runs (deepinfer-eval)", "",
                  "| run | suite | model | tasks | concurrency | thresholds (held / missed) | min agreement |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [_eval_line(run_dir) for run_dir in evals]
    path = report_root / "index.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def _sweep_line(report_root: Path, run_dir: Path) -> str:
    rows, unreadable = readable_rows(run_dir)
    if unreadable:
        return f"| {run_dir.name}{unreadable} | {run_dir.parent.name} |  |  |  |"
    ok_keys = {r["key"] for r in rows if r.get("status") == "ok"}
    failed = {r["key"] for r in rows if r.get("status") != "ok"} - ok_keys     # points, not attempts
    charts = ", ".join(f"[{p.stem}]({p.relative_to(report_root).as_posix()})"
                       for p in sorted(run_dir.glob("*_pareto.*")))
    return (f"| {run_dir.name} | {run_dir.parent.name} | {len(ok_keys)} / {len(failed)} | {routing_verdict(rows)} "
            f"| {charts} |")


def _eval_line(run_dir: Path) -> str:
    rows, unreadable = readable_rows(run_dir)
    if unreadable:
        return f"| {run_dir.name}{unreadable} |  |  |  |  |  |  |"
    metrics = [r for r in rows if r.get("kind") == "eval" and r.get("engine") == "deepinfer"]
    agree = [r["value"] for r in rows if r.get("kind") == "agreement" and isinstance(r.get("value"), float)
             and r["value"] == r["value"]]
    whole = any(r.get("kind") == "summary" and r.get("complete") for r in rows)
    state = "" if whole else " (method 1: no completion marker)" if rows and rows[0].get("method_version") == "1" \
        else " (incomplete)"
    checked = [r for r in rows if r.get("passed") is not None]
    first = rows[0] if rows else {}
    agreement = f"{min(agree):.3f}" if agree else ""
    return (f"| {run_dir.name}{state} | {first.get('suite', '')} | {first.get('model', '')} | "
            f"{', '.join(sorted({r['task'] for r in metrics}))} | "
            f"{', '.join(str(c) for c in sorted({r['concurrency'] for r in metrics}))} | "
            f"{sum(r['passed'] for r in checked)} / {sum(not r['passed'] for r in checked)} | {agreement} |")


def comparison_charts(run_dir: Path, rows: list[dict], other: Path, other_rows: list[dict], png: bool = True
                      ) -> list[Path]:
    """Charts of this run's points against another run's, a series per run: <mode>_vs_<other>.html (and .png)
    beside the run's own charts, for every mode both runs have."""
    written = []
    for mode in CHARTS:
        if not any(r["mode"] == mode for r in rows) or not any(r["mode"] == mode for r in other_rows):
            continue
        fig = pareto_figure(rows + other_rows, mode, f"{run_dir.name} against {other.name}: {mode} Pareto", by_run=True)
        files, png = _write_figure(fig, run_dir / f"{mode}_vs_{other.name}", f"{mode}-vs", png)
        written += files
    return written


BENCH_TABLES = {"step": "step_bench", "dspark": "dspark_bench", "structured": "structured_bench",
                "versus": "versus_bench"}     # benches whose runs have no charts: their end-of-run table instead


def bench_table(run_dir: Path) -> list[str]:
    """The end-of-run table of a step / dspark / structured / versus run (traffic column included), from its
    stored rows; [] for other runs, and one line when the rows predate a field the table reads."""
    import importlib
    rows = read_rows(run_dir)
    benches = {r.get("bench") for r in rows}
    if len(benches) != 1 or next(iter(benches)) not in BENCH_TABLES:
        return []
    module = importlib.import_module(f".{BENCH_TABLES[next(iter(benches))]}", __package__)
    try:
        table = module.table(rows)
        return table if len(table) > 1 else []                    # a header alone: no finished point
    except KeyError as e:
        return [f"(no table: these rows predate the field {e.args[0]!r} the table reads)"]


def report_run(run_dir: Path, png: bool = True, rows: list[dict] | None = None) -> list[Path]:
    """summary.csv and the charts of one run, from its ok sweep rows (`rows`: ok_rows(run_dir), already read)."""
    rows = ok_rows(run_dir) if rows is None else rows
    out = [write_summary(run_dir, rows)]
    return out + write_charts(run_dir, rows, png)


def _hover(r: dict) -> str:
    fields = [("point", r["key"]), ("model", r.get("model")), ("hardware", r.get("hardware")),
              ("gpus", r.get("gpus")), ("p50 TTFT s", r.get("median_ttft")), ("p99 TTFT s", r.get("p99_ttft")),
              ("p50 TPOT s", r.get("median_tpot")), ("in tok/s/GPU", r.get("input_tput_per_gpu")),
              ("out tok/s/GPU", r.get("output_tput_per_gpu")),
              ("experts touched/uniform, max/mean", traffic_cell(r))]
    return "<br>".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in fields)
