"""The `deepinfer-bench` command (docs/bench.md). `deepinfer-bench sweep` with no arguments runs the default
tiny CPU sweep (about three minutes) and writes its report under reports/."""

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
@click.option("--no-report", is_flag=True, help="write rows only; make the charts later with deepinfer-bench report "
                                                "(e.g. where plotly and a browser are installed)")
def sweep_cmd(sweep_file, model, device, prefill_ranks, decode_ranks, report_dir, run_id, resume, continue_on_error,
              no_progress, no_report) -> None:
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
    from .ranks import from_env
    if not from_env().main:                          # a torchrun launch: rank 0 reports
        return
    written = []
    if not no_report:
        from .report import report_run, write_index
        written = report_run(run_dir)
        write_index(Path(report_dir))
    rows = [r for r in _rows(run_dir) if r["status"] == "ok"]
    click.echo(f"{len(rows)} points in {run_dir}; " + (", ".join(p.name for p in written) if written else
                                                       f"no report: deepinfer-bench report {run_dir.name}"))
    for r in rows:
        if r["mode"] == "decode":
            click.echo(f"  {r['key']:<28} {_num(r['output_tput_per_gpu'], '9.1f')} out tok/s/GPU  "
                       f"{_num(r['median_intvty'], '8.1f')} tok/s/user")
        else:
            click.echo(f"  {r['key']:<28} {_num(r['input_tput_per_gpu'], '9.1f')} in tok/s/GPU   "
                       f"TTFT p99 {_num(r['p99_ttft'], '.3f')} s")


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
    if not root.is_dir():
        raise DeepInferError(f"no report directory {root}: run a sweep first, or pass --report-dir")
    from .report import sweep_runs
    runs = sweep_runs(root)
    if not all_runs:
        if not run_ids:
            raise click.UsageError("name RUN_IDS or pass --all")
        missing = [r for r in run_ids if not any(d.name == r for d in runs)]
        if missing:
            raise DeepInferError(f"no stored rows for run(s) {missing} under {root} (runs there: "
                                 f"{[d.name for d in runs][:10]})")
        runs = [d for d in runs if d.name in run_ids]
    from .report import ok_rows
    for run_dir in runs:
        if not ok_rows(run_dir):
            click.echo(f"{run_dir}: no sweep points (a check run or nothing finished): no charts")
            continue
        written = report_run(run_dir, png=not no_png)
        click.echo(f"{run_dir}: " + ", ".join(p.name for p in written))
    click.echo(f"index: {write_index(root)}")


@cli.command("step", epilog="""Example (one H200, bf16 V4 flash-width, 4 layers):

\b
  deepinfer-bench step --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16 \\
      --batch 1,16,64,256 --context 1024,8192 --prefill 8192
  deepinfer-bench step --model random:deepseek_v41:flash:4 --device cuda --dtype bfloat16 \\
      --expert-storage fp4 --batch 1,16,64,256 --context 1024,8192

Without options: the tiny V4 model on CPU, batches 1,8 at contexts 128,512 (seconds).""")
@click.option("--model", default=None, help="random:ARCH:PRESET:LAYERS, tiny, a checkpoint dir or hub id "
                                            "[default: random:deepseek_v4:tiny:4]")
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N")
@click.option("--dtype", default="float32", show_default=True, help="float32 | bfloat16 | ...")
@click.option("--expert-storage", type=click.Choice(["dense", "fp4"]), default="dense", show_default=True)
@click.option("--kernel-backend", type=click.Choice(["reference", "invariant"]), default=None,
              help="kernel backend set [default: the engine's, DEEPINFER_KERNEL_BACKEND or reference]")
@click.option("--batch", "batches", default=None, help="rows per decode step, comma-separated [default: 1,8]")
@click.option("--context", "contexts", default=None,
              help="positions already in each row's state, comma-separated [default: 128,512]")
@click.option("--query-len", type=int, default=1, show_default=True,
              help="tokens per row (1: decode; > 1: verify-shaped rows)")
@click.option("--prefill", default=None, help="also prefill points: one row of T tokens from an empty state, "
                                              "comma-separated T (alone: prefill points only)")
@click.option("--iters", type=int, default=20, show_default=True, help="timed steps per point")
@click.option("--warmup", type=int, default=3, show_default=True, help="untimed steps per point first")
@click.option("--trace-steps", type=int, default=5, show_default=True, help="steps in the GPU idle trace")
@click.option("--no-graphs", is_flag=True, help="eager steps (the engine's enforce_eager)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--report-dir", default="reports", show_default=True)
@click.option("--run-id", default=None, help="run directory name [default: step-<time>]")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="run directory (overrides --report-dir / --run-id)")
@click.option("--resume", is_flag=True, help="continue the run --run-id / --out: skip finished points")
@click.option("--continue-on-error", is_flag=True, help="record a failed point and go on")
def step_cmd(model, device, dtype, expert_storage, kernel_backend, batches, contexts, query_len, prefill, iters,
             warmup, trace_steps, no_graphs, seed, report_dir, run_id, out, resume, continue_on_error) -> None:
    """Decode / verify / prefill step time against its roofline: one row per point (docs/bench.md).

    Per point: measured step time (CUDA events over graph replays on a GPU), the roofline from the bytes the
    step must read (dense weights, the experts its routing selects, state) and its FLOPs over copy bandwidth
    and GEMM peak measured in the same run, their ratio, and the GPU idle fraction between steps."""
    from .step_bench import DEFAULT_MODEL, StepConfig, parse_int_list, run_step_bench, table
    if resume and not (run_id or out):
        raise click.UsageError("--resume needs the --run-id (or --out) of the run to continue")
    pre = parse_int_list(prefill, "--prefill")
    b, c = parse_int_list(batches, "--batch"), parse_int_list(contexts, "--context", minimum=0)
    if not pre or batches is not None or contexts is not None:
        b, c = b or (1, 8), c or (128, 512)
    cfg = StepConfig(model=model or DEFAULT_MODEL, device=device, dtype=dtype, expert_storage=expert_storage,
                     kernel_backend=kernel_backend, batches=b, contexts=c, query_len=query_len, prefill=pre,
                     iters=iters, warmup=warmup, trace_steps=trace_steps, graphs=not no_graphs, seed=seed)
    run_dir, rows = run_step_bench(cfg, report_dir, run_id, out, resume, continue_on_error, echo=click.echo)
    click.echo(f"rows in {run_dir / 'rows.jsonl'}")
    for line in table(rows):
        click.echo("  " + line)


def _check_options(f):
    for opt in reversed([
        click.option("--model", default="tiny", show_default=True, help="dir, hub id, tiny or random:ARCH:PRESET:N"),
        click.option("--device", default="cpu", show_default=True),
        click.option("--dtype", default="float32", show_default=True),
        click.option("--max-tokens", type=int, default=32, show_default=True),
        click.option("--prompt-len", type=int, default=48, show_default=True),
        click.option("--mode", "modes", type=click.Choice(["both", "on", "off"]), default="both", show_default=True,
                     help="batch-invariant mode off, on, or both"),
        click.option("--seed", type=int, default=0, show_default=True),
        click.option("--report-dir", default="reports", show_default=True),
        click.option("--run-id", default=None)]):
        f = opt(f)
    return f


@cli.command("determinism")
@_check_options
@click.option("--runs", type=int, default=50, show_default=True, help="repetitions of the same prompts")
@click.option("--num-prompts", type=int, default=8, show_default=True)
def determinism_cmd(runs, num_prompts, **kw) -> None:
    """The same prompts N times (greedy and seeded; shuffled, at changing concurrency): unique outputs per prompt
    and the first divergence."""
    _run_check("determinism", kw, runs=runs, num_prompts=num_prompts, trials=None)


@cli.command("batch-invariance")
@_check_options
@click.option("--trials", type=int, default=20, show_default=True, help="batches the needle is placed in")
def batch_invariance_cmd(trials, **kw) -> None:
    """A needle prompt alone vs at random slots of random batches: tokens and logprobs compared bitwise."""
    _run_check("batch-invariance", kw, runs=None, num_prompts=1, trials=trials)


def _run_check(kind: str, kw: dict, runs: int | None, num_prompts: int, trials: int | None) -> None:
    from .checks import run_checks
    from .rows import SCHEMA_VERSION, run_id_for
    from .sweep import build_llm
    from .sweep_config import parse_sweep
    from .workload import random_workload
    for name, value in (("--runs", runs), ("--num-prompts", num_prompts), ("--trials", trials),
                        ("--max-tokens", kw["max_tokens"]), ("--prompt-len", kw["prompt_len"])):
        if value is not None and value < 1:
            raise click.UsageError(f"{name} must be at least 1")
    max_len = kw["prompt_len"] * 2 + kw["max_tokens"] + 8
    cfg = parse_sweep({"name": kind, "model": kw["model"], "device": kw["device"], "dtype": kw["dtype"],
                       "engine_args": {"max_model_len": max_len, "max_num_seqs": 32},
                       "scenarios": [{"isl": kw["prompt_len"], "osl": kw["max_tokens"]}], "concurrency": [1],
                       "seed": kw["seed"]}, f"deepinfer-bench {kind}")
    llm = build_llm(cfg)
    prompts = random_workload(num_prompts, kw["prompt_len"], 1, 0.5, llm.model.cfg.vocab_size, kw["seed"]).prompts
    run_id = run_id_for(kw["run_id"], kind)
    run_dir = Path(kw["report_dir"]) / SCHEMA_VERSION / run_id
    modes = {"both": [False, True], "on": [True], "off": [False]}[kw["modes"]]
    rows = run_checks(llm, kind, modes, run_dir, prompts, runs or 0, trials or 0, kw["max_tokens"], kw["seed"])
    click.echo(f"{kind}: rows in {run_dir}")
    for r in rows:
        mode = "batch-invariant" if r["batch_invariant"] else "default        "
        if kind == "determinism":
            diverged = [d for d in r["first_divergence"] if d is not None]
            click.echo(f"  {mode} {r['sampling']:<7} unique outputs per prompt: max {max(r['unique'])} "
                       f"(of {runs} runs); first divergence: {min(diverged) if diverged else 'none'}")
        else:
            click.echo(f"  {mode} {r['sampling']:<7} {r['token_mismatches']}/{r['trials']} batches change the "
                       f"tokens, {r['logprob_mismatches']}/{r['trials']} change the logprobs")


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def _rows(run_dir):
    from .rows import read_rows
    return read_rows(run_dir)


def main() -> None:
    run_cli(cli)
