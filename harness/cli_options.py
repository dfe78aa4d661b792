"""The options the `deepinfer-bench` and `deepinfer-eval` commands share, written once (each command stacks the
ones it takes), and the epilogue every bench command prints.

    @cli.command("structured")
    @model_option("tiny", MODEL_HELP)
    @device_option()
    @dtype_option()
    @run_dir_options("structured")
    def structured_cmd(model, device, dtype, report_dir, run_id, out): ..."""

from __future__ import annotations

from pathlib import Path

import click

from deepinfer.validate import DTYPE_NAMES, EXPERT_STORAGE

from .options import SEED

DEVICE_HELP = "cpu | cuda | cuda:N (GPU N)"
MODEL_HELP = "dir, hub id, tiny or random:ARCH:PRESET:N"


def not_blank(ctx, param, value):
    """click callback: an option or argument given as an empty or blank string is refused in one line (never
    read as 'not given')."""
    if isinstance(value, str) and not value.strip():
        raise click.BadParameter(f"{value!r} is empty; give a value, or leave {param.get_error_hint(ctx)} out",
                                 ctx, param)
    return value


def not_blank_each(ctx, param, values):
    """not_blank for every value of a repeatable option or a variadic argument."""
    return [not_blank(ctx, param, v) for v in values]


def stacked(*decorators):
    """One decorator applying `decorators` so that the options read in --help in the order given."""
    def apply(f):
        for decorator in reversed(decorators):
            f = decorator(f)
        return f
    return apply


def model_option(default: str | None, help: str = MODEL_HELP):
    return click.option("--model", default=default, show_default=default is not None, callback=not_blank,
                        help=help)


def device_option(default: str | None = "cpu", help: str = DEVICE_HELP):
    return click.option("--device", default=default, show_default=default is not None, callback=not_blank,
                        help=help)


def dtype_option(default: str | None = "float32", help: str | None = None):
    return click.option("--dtype", type=click.Choice(DTYPE_NAMES), default=default,
                        show_default=default is not None, help=help)


def expert_storage_option():
    return click.option("--expert-storage", type=click.Choice(EXPERT_STORAGE), default="dense", show_default=True)


def seed_option():
    return click.option("--seed", type=SEED, default=0, show_default=True)


def report_dir_option():
    return click.option("--report-dir", default="reports", show_default=True, callback=not_blank)


def run_id_option(default_help: str):
    return click.option("--run-id", default=None, callback=not_blank, help=f"run directory name [default: "
                                                                            f"{default_help}]")


def run_dir_options(name: str, out: bool = True, resume: bool = False, continue_on_error: bool = False):
    """--report-dir, --run-id (default: NAME-<time>), --out (the run directory itself), and where the bench can
    continue a run, --resume and --continue-on-error."""
    where = "--run-id / --out" if out else "--run-id"
    decorators = [report_dir_option(), run_id_option(f"{name}-<time>")]
    if out:
        decorators.append(click.option("--out", default=None, callback=not_blank, type=click.Path(file_okay=False),
                                       help="run directory (overrides --report-dir / --run-id)"))
    if resume:
        decorators.append(click.option("--resume", is_flag=True, help=f"continue the run {where}: skip finished "
                                                                       f"points, retry failed ones"))
    if continue_on_error:
        decorators.append(click.option("--continue-on-error", is_flag=True,
                                       help="record a failed point and go on"))
    return stacked(*decorators)


def check_resume(resume: bool, run_id: str | None, out: str | None = None, has_out: bool = True) -> None:
    """--resume names the run it continues."""
    if resume and not (run_id or out):
        raise click.UsageError(f"--resume needs the --run-id{' (or --out)' if has_out else ''} of the run to "
                               f"continue")


def echo_rows(run_dir: Path, lines: list[str]) -> None:
    """The epilogue of a bench command: where its rows are, then its table."""
    click.echo(f"rows in {Path(run_dir) / 'rows.jsonl'}")
    for line in lines:
        click.echo("  " + line)


def index_hint(report_dir, run_dir) -> str:
    """The line sweep / eval print instead of rewriting the index (publishing is `deepinfer-bench report`)."""
    where = "" if str(report_dir) == "reports" else f" --report-dir {report_dir}"
    return (f"{Path(report_dir) / 'index.md'} not rewritten; to publish this run: git add -f {run_dir}, then "
            f"deepinfer-bench report --all{where}")
