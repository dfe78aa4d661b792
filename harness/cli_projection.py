"""`deepinfer-bench projection ...`: the EP decode projection's own commands (docs/projection.md). A group of its
own module, registered by cli.py, which stays under ~600 lines."""

from __future__ import annotations

import click

from .cli_options import not_blank, report_dir_option


@click.group("projection", epilog="""Examples:

\b
  deepinfer-bench projection validate                   # the error table: reports/projection/validation.md""")
def projection() -> None:
    """The EP decode projection (harness/projection/): its validation against published deployments."""


@projection.command("validate", epilog="""Examples:

\b
  deepinfer-bench projection validate
  deepinfer-bench projection validate --hardware-file my-hardware.json --comm-file my-comm.json

Writes REPORT_DIR/projection/validation.md and validation.csv; a miss is a documented row (exit 0), missing data
one error line.""")
@report_dir_option()
@click.option("--hardware-file", default=None, callback=not_blank, type=click.Path(dir_okay=False),
              help="hardware profiles [default: the packaged harness/projection/data/hardware.json]")
@click.option("--comm-file", default=None, callback=not_blank, type=click.Path(dir_okay=False),
              help="dispatch / combine series [default: the packaged harness/projection/data/comm.json]")
@click.option("--anchors-file", default=None, callback=not_blank, type=click.Path(dir_okay=False),
              help="published and own anchors, kernel rates [default: the packaged data/anchors.json]")
def validate_cmd(report_dir, hardware_file, comm_file, anchors_file) -> None:
    """The projection against published large-EP deployments on their own configurations (the op-level model) and
    against our own measured steps (each interior batch predicted from the others): projected vs published, the
    error, within the bound or the miss's cause."""
    from .projection.validate import table_lines, validate
    rows, written = validate(report_dir, hardware_file, comm_file, anchors_file)
    for line in table_lines(rows):
        click.echo(line)
    misses = sum(r.within is False for r in rows)
    click.echo(f"{len(rows)} anchors, {misses} outside their bound (causes in the table); "
               + ", ".join(str(p) for p in written))


@click.command("plan", epilog="""Examples:

\b
  deepinfer-bench plan --gpus 16 --model V4.1-Flash --slo-tpot 30ms
  deepinfer-bench plan --gpus 64 --model V4-Flash --slo-tpot 50ms --hardware H800 --isl 8192 --osl 1024

Every candidate is projected (docs/projection.md, "Plan"); its rows go to REPORT_DIR/1/RUN_ID/rows.jsonl.""")
@click.option("--gpus", type=click.IntRange(1), required=True, help="GPUs to deploy decode on")
@click.option("--model", default="V4.1-Flash", show_default=True, callback=not_blank,
              help="V4.1-Flash, V4-Flash, or random:ARCH:flash:LAYERS")
@click.option("--slo-tpot", required=True, callback=not_blank, help="time per output token to meet: 30ms, 0.03s")
@click.option("--hardware", default=None, callback=not_blank,
              help="the GPU profile (H200, H100, H800, B200, GB200) [default: the calibration's]")
@click.option("--isl", type=click.IntRange(1), default=1024, show_default=True, help="prompt tokens")
@click.option("--osl", type=click.IntRange(1), default=1024, show_default=True, help="output tokens")
@click.option("--calibration", default=None, callback=not_blank,
              help="the rank-view step run that calibrates decode [default: the best under REPORT_DIR]")
@click.option("--top", type=click.IntRange(1), default=5, show_default=True, help="candidates that fit to list")
@report_dir_option()
@click.option("--run-id", default=None, callback=not_blank, help="the rows' run directory [default: plan-<time>]")
def plan_cmd(gpus, model, slo_tpot, hardware, isl, osl, calibration, top, report_dir, run_id) -> None:
    """The deployment of GPUS GPUs (EP width x replicas, DSpark off / fixed / confidence) with the most projected
    output tokens/s per GPU whose TPOT meets the SLO, and the runners-up."""
    from pathlib import Path

    from .projection.plan import parse_tpot, plan, table
    from .projection.sweep import PROJECTION_VERSION
    from .rows import SCHEMA_VERSION, RowStore, environment, identity, refuse_existing_rows, run_dir_guard, run_id_for
    slo = parse_tpot(slo_tpot)
    folder = Path(report_dir) / SCHEMA_VERSION / run_id_for(run_id, "plan")
    refuse_existing_rows(folder, resumable=False)
    proj, candidates = plan(gpus, model, slo, report_dir, hardware, isl, osl, calibration)
    click.echo(f"{gpus} x {proj.hardware.name}, {model}, TPOT <= {slo:g} ms, ISL {isl} / OSL {osl}: projected "
               f"(calibration {proj.decode.run}; error band {proj.fields()['error_band']})")
    for line in table(candidates, top):
        click.echo(line)
    with run_dir_guard(folder):
        store = RowStore(folder)
        base = identity(environment(), "projection-" + PROJECTION_VERSION, bench="plan", model=model, gpus=gpus,
                        slo_tpot_ms=slo, isl=isl, osl=osl, is_projected=True, projection=proj.fields())
        for c in candidates:
            store.append({**base, "key": f"ep{c.ep}/{c.spec_mode}", "status": "ok", **c.fields()})
    click.echo(f"rows: {folder / 'rows.jsonl'}")
