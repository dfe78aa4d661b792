"""The `deepinfer-bench` command (docs/bench.md). `deepinfer-bench sweep` with no arguments runs the default
tiny CPU sweep (about two minutes) and writes its report under reports/."""

from __future__ import annotations


from pathlib import Path

import click

from deepinfer.cli import run_cli


@click.group(help="deepinfer-bench: benchmark sweeps (prefill / decode Pareto points) into versioned reports.")
def cli() -> None:
    """Command group; the subcommands below do the work."""


@cli.command("sweep")
@click.argument("sweep_file", required=False)
@click.option("--model", default=None, help="override the sweep's model (dir, hub id, tiny, random:ARCH:PRESET:N)")
@click.option("--device", default=None, help="override the sweep's device (cpu | cuda)")
@click.option("--prefill-ranks", type=int, default=None, help="ranks for prefill points")
@click.option("--decode-ranks", type=int, default=None, help="ranks for decode points")
@click.option("--report-dir", default="reports", show_default=True)
@click.option("--run-id", default=None, help="run directory name (default: time + sweep name)")
@click.option("--resume", is_flag=True, help="continue the run --run-id: skip finished points, retry failed ones")
@click.option("--continue-on-error", is_flag=True, help="record a failed point and go on")
@click.option("--no-progress", is_flag=True)
def sweep_cmd(sweep_file, model, device, prefill_ranks, decode_ranks, report_dir, run_id, resume, continue_on_error,
              no_progress) -> None:
    """Run SWEEP_FILE (a sweeps/*.yaml definition; default: the tiny CPU sweep) and write one row per point."""
    from .sweep import default_sweep, run_sweep
    from .sweep_config import load_sweep, parse_sweep
    cfg = load_sweep(sweep_file) if sweep_file else default_sweep()
    if resume and not run_id:
        raise click.UsageError("--resume needs the --run-id of the run to continue")
    overrides = {k: v for k, v in (("model", model), ("device", device)) if v is not None}
    topo = {k: v for k, v in (("prefill_ranks", prefill_ranks), ("decode_ranks", decode_ranks)) if v is not None}
    if overrides or topo:
        d = cfg.to_dict()
        d.update(overrides)
        d["topology"] = {**d["topology"], **topo}
        cfg = parse_sweep(d, f"{cfg.source} (with command-line overrides)")
    run_dir = run_sweep(cfg, report_dir, run_id, resume, continue_on_error, progress=not no_progress)
    from .report import report_run, write_index
    written = report_run(run_dir)
    write_index(Path(report_dir))
    rows = [r for r in _rows(run_dir) if r["status"] == "ok"]
    click.echo(f"{len(rows)} points in {run_dir}; " + ", ".join(p.name for p in written))
    for r in rows:
        if r["mode"] == "decode":
            click.echo(f"  {r['key']:<28} {r['output_tput_per_gpu']:9.1f} out tok/s/GPU  "
                       f"{r['median_intvty']:8.1f} tok/s/user")
        else:
            click.echo(f"  {r['key']:<28} {r['input_tput_per_gpu']:9.1f} in tok/s/GPU   "
                       f"TTFT p99 {r['p99_ttft']:.3f} s")


@cli.command("report")
@click.argument("run_ids", nargs=-1)
@click.option("--all", "all_runs", is_flag=True, help="every run under the report dir")
@click.option("--report-dir", default="reports", show_default=True)
@click.option("--no-png", is_flag=True, help="HTML and CSV only")
def report_cmd(run_ids, all_runs, report_dir, no_png) -> None:
    """Regenerate summary.csv and the Pareto charts of RUN_IDS (or --all) from their stored rows, and the index."""
    from deepinfer.errors import DeepInferError

    from .report import report_run, write_index
    root = Path(report_dir)
    runs = sorted(p.parent for p in root.glob("*/*/rows.jsonl"))
    if not all_runs:
        if not run_ids:
            raise click.UsageError("name RUN_IDS or pass --all")
        missing = [r for r in run_ids if not any(d.name == r for d in runs)]
        if missing:
            raise DeepInferError(f"no stored rows for run(s) {missing} under {root} (runs there: "
                                 f"{[d.name for d in runs][:10]})")
        runs = [d for d in runs if d.name in run_ids]
    for run_dir in runs:
        written = report_run(run_dir, png=not no_png)
        click.echo(f"{run_dir}: " + ", ".join(p.name for p in written))
    click.echo(f"index: {write_index(root)}")


def _rows(run_dir):
    from .rows import RowStore
    return RowStore(run_dir).rows()


def main() -> None:
    run_cli(cli)
