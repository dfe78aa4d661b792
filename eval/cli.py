"""The `deepinfer-eval` command (docs/eval.md): lm-eval accuracy suites on the engine."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from deepinfer.cli import run_cli
from deepinfer.harness.cli_options import (DEVICE_HELP, device_option, dtype_option, index_hint, model_option,
                                           not_blank, run_id_option)
from deepinfer.harness.options import DIGITS, Count


@click.group(help="deepinfer-eval: lm-eval accuracy suites on the engine, results into reports/eval/.")
def cli() -> None:
    """Command group; the subcommands below do the work."""


@cli.command("run", epilog="""Examples:

\b
  deepinfer-eval run                                      # = --suite offline-smoke: tiny model, CPU, offline
  deepinfer-eval run --tasks deepinfer_text --limit 4 --out /tmp/eval
  deepinfer-eval run --suite flash-4l-offline --device cuda
  deepinfer-eval run --tasks gsm8k,mmlu --model DIR --device cuda --dtype bfloat16 --limit 200

Exit status 0; 1 when a metric misses its suite threshold; 2 on bad input. Runs go to --out/RUN_ID/
(reports/eval/: git-ignored until published); reports/index.md is rewritten by deepinfer-bench report only.""")
@click.option("--suite", "suite_name", default=None, callback=not_blank,
              help="a suite under eval/suites/ (deepinfer-eval suites) or a suite YAML path")
@click.option("--tasks", default=None, callback=not_blank,
              help="comma-separated tasks instead of a suite (offline or lm-eval names)")
@model_option(None, "override the suite's model (checkpoint dir, hub id, tiny, random:ARCH:PRESET:N)")
@device_option(None, f"override the suite's device: {DEVICE_HELP}")
@dtype_option(None, "override the suite's dtype")
@click.option("--limit", type=Count(1), default=None, help="samples per task")
@click.option("--num-fewshot", type=Count(0), default=None, help="few-shot examples for every task")
@click.option("--concurrency", default=None, callback=not_blank,
              help="comma-separated: integers, max, median (default: the suite's)")
@click.option("--batch-invariant/--no-batch-invariant", default=None,
              help="batch-invariant mode on / off (default: the suite's)")
@click.option("--apply-chat-template", is_flag=True, default=None, help="render prompts with the chat template")
@click.option("--max-model-len", type=Count(1), default=None, help="override engine_args.max_model_len")
@click.option("--max-num-seqs", type=Count(1), default=None,
              help="override engine_args.max_num_seqs (= 'max' concurrency)")
@click.option("--reference", type=click.Choice(["transformers"]), default=None,
              help="also run the tasks through lm-eval's HF backend on the same V4 checkpoint (QAT off on ours)")
@click.option("--confirm-run-unsafe-code", is_flag=True,
              help="let tasks that execute model-written code run (HumanEval; lm-eval's own switch)")
@click.option("--out", default="reports/eval", show_default=True, callback=not_blank, help="results root")
@run_id_option("<time>-<suite name>")
@click.option("--quiet", is_flag=True, help="no progress bars, lm-eval warnings only")
def run_cmd(suite_name, tasks, model, device, dtype, limit, num_fewshot, concurrency, batch_invariant,
            apply_chat_template, max_model_len, max_num_seqs, reference, confirm_run_unsafe_code, out, run_id,
            quiet) -> None:
    """Run a suite (default: offline-smoke) and write results, rows and samples under --out/RUN_ID; exit status 1
    when a metric misses its suite threshold."""
    from deepinfer.harness.report import EVAL_DIR

    from .run import run_suite
    from .suite import load_suite, parse_suite
    if suite_name is not None and tasks is not None:
        raise click.UsageError("give --suite or --tasks, not both")
    if quiet:
        logging.getLogger("lm-eval").setLevel(logging.WARNING)
        logging.getLogger("lm_eval").setLevel(logging.WARNING)
    if tasks is not None:
        d = {"name": "adhoc", "model": "tiny", "tasks": comma_list(tasks, "--tasks", "deepinfer_arith,deepinfer_text")}
    else:
        d = load_suite(suite_name or "offline-smoke").to_dict()
    overrides = {"model": model, "device": device, "dtype": dtype, "limit": limit,
                 "batch_invariant": batch_invariant, "apply_chat_template": apply_chat_template}
    d.update({k: v for k, v in overrides.items() if v is not None})
    if concurrency is not None:
        d["concurrency"] = [int(c) if DIGITS.fullmatch(c) else c      # a word (max, median): the suite checks it
                            for c in comma_list(concurrency, "--concurrency", "8,max")]
    for key, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
        if value is not None:
            d["engine_args"] = {**d.get("engine_args", {}), key: value}
    if num_fewshot is not None:
        d["tasks"] = [{**(t if isinstance(t, dict) else {"task": t}), "num_fewshot": num_fewshot} for t in d["tasks"]]
    suite = parse_suite(d, f"{suite_name or ('--tasks' if tasks else 'offline-smoke')} (with command-line options)")
    run = run_suite(suite, out, run_id, reference, progress=not quiet, unsafe_code=confirm_run_unsafe_code)
    _print(run)
    out_path = Path(out)
    if out_path.name == EVAL_DIR:                    # <reports>/eval: the reports index lists eval runs too
        click.echo(index_hint(out_path.parent, run.run_dir))
    if run.failures:
        click.echo(f"{len(run.failures)} threshold(s) missed: " + "; ".join(
            f"{r['task']} {r['metric']} = {r['value']:.4g} (c={r['concurrency']}), wants {r['bound']}"
            for r in run.failures), err=True)
        sys.exit(1)


def comma_list(text: str, option: str, example: str) -> list[str]:
    """'a, b' -> ['a', 'b']; an empty entry (',', 'a,,b', ' , ') is one error line."""
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise click.BadParameter(f"{text!r} has an empty entry; give comma-separated values, e.g. {example}",
                                 param_hint=f"'{option}'")
    return items


@cli.command("suites", epilog="""Example:

\b
  deepinfer-eval suites                                   # then: deepinfer-eval run --suite NAME""")
def suites_cmd() -> None:
    """List the suites under eval/suites/ and the offline tasks."""
    from .suite import load_suite, suite_names
    from .tasks import offline_tasks
    for name in suite_names():
        s = load_suite(name)
        click.echo(f"{name:<24} {s.model:<40} {', '.join(t.name for t in s.tasks)}")
    click.echo(f"offline tasks: {', '.join(offline_tasks())}")


def _print(run) -> None:
    click.echo(f"eval rows in {run.run_dir}")
    for r in run.rows:
        who = r["engine"] if r["engine"] != "deepinfer" else f"c={r['concurrency']}"
        extra = f"  max |dloglik| {r['max_abs_loglik_diff']:.2e}" if "max_abs_loglik_diff" in r else ""
        verdict = "  no threshold" if r.get("passed") is None else \
            f"  ok ({r['bound']})" if r["passed"] else f"  MISSED ({r['bound']})"
        label = r["metric"] if r["kind"] == "eval" else f"agreement with {r['versus']}"
        click.echo(f"  {who:<13} {r['task']:<20} {label:<34} "
                   f"{r['value']:.4g}{extra}{verdict}")


def main() -> None:
    run_cli(cli)
