"""The `deepinfer-bench` command (docs/bench.md). `deepinfer-bench sweep` with no arguments runs the default
tiny CPU sweep (about three minutes) and writes its run under reports/1/ (git-ignored until published: `git add -f`
the run, then `deepinfer-bench report --all` rewrites reports/index.md)."""

from __future__ import annotations

from pathlib import Path

import click

from deepinfer.cache.pools import KV_CACHE_DTYPES
from deepinfer.cli import run_cli
from deepinfer.kernels.registry import BACKEND_SETS
from deepinfer.validate import PROJECTION_STORAGE

from .checks import CHECK_MODES
from .cli_projection import plan_cmd, projection
from .cli_options import (DEVICE_HELP, check_resume, device_option, dtype_option, echo_rows, expert_storage_option,
                          index_hint, model_option, not_blank, not_blank_each, report_dir_option, run_dir_options,
                          run_id_option, seed_option, stacked)
from .kernel_bench import OPS as KOPS
from .options import Count, parse_int_list, parse_names, split_items
from .versus_bench import ENGINES as VERSUS_ENGINES


@click.group(help="deepinfer-bench: benchmark sweeps (prefill / decode Pareto points) into versioned reports.")
def cli() -> None:
    """Command group; the subcommands below do the work."""


@cli.command("sweep", epilog="""Examples:

\b
  deepinfer-bench sweep                                   # the tiny CPU sweep (about 3 minutes)
  deepinfer-bench sweep sweeps/h200-v4-flash-4l.yaml --run-id h200-v4-flash-4l
  deepinfer-bench sweep sweeps/h200-v4-flash-4l.yaml --run-id h200-v4-flash-4l --resume
  torchrun --nproc-per-node 2 $(which deepinfer-bench) sweep sweeps/h200x2-v4-flash-4l-dp.yaml
  deepinfer-bench sweep --decode-ranks 64                 # projected: V4.1-Flash at 4 prefill / 64 decode ranks

The run goes to REPORT_DIR/1/RUN_ID/ (under reports/: git-ignored until published with git add -f);
reports/index.md is rewritten by deepinfer-bench report only.""")
@click.argument("sweep_file", required=False, callback=not_blank)
@model_option(None, "override the sweep's model (dir, hub id, tiny, random:ARCH:PRESET:N)")
@device_option(None, f"override the sweep's device: {DEVICE_HELP}")
@click.option("--prefill-ranks", type=Count(1), default=None, help="ranks for prefill points")
@click.option("--decode-ranks", type=Count(1), default=None, help="ranks for decode points")
@report_dir_option()
@run_id_option("<time>-<sweep name>")
@click.option("--resume", is_flag=True, help="continue the run --run-id: skip finished points, retry failed ones")
@click.option("--continue-on-error", is_flag=True, help="record a failed point and go on")
@click.option("--no-progress", is_flag=True)
@click.option("--no-report", is_flag=True, help="write rows only; make the charts later with deepinfer-bench report "
                                                "(e.g. where plotly and a browser are installed)")
@click.option("--project", is_flag=True, help="project every point instead of measuring it (docs/projection.md); "
                                              "without a sweep file: the published shape (V4.1-Flash, 4 / 64 ranks)")
@click.option("--measure", is_flag=True, help="measure only: refuse where this launch lacks the sweep's ranks")
@click.option("--hardware", default=None, callback=not_blank,
              help="projection: the GPU profile projected (H200, H100, H800, B200, GB200) [default: the calibration's]")
@click.option("--calibration", default=None, callback=not_blank,
              help="projection: the rank-view step run that calibrates decode [default: the best under REPORT_DIR]")
def sweep_cmd(sweep_file, model, device, prefill_ranks, decode_ranks, report_dir, run_id, resume, continue_on_error,
              no_progress, no_report, project, measure, hardware, calibration) -> None:
    """Run SWEEP_FILE (a sweeps/*.yaml definition; default: the tiny CPU sweep) and write one row per point, then
    the run's summary.csv and charts. Where this machine lacks the sweep's ranks (and the model is one the
    projection knows), every point is projected instead, with a notice line (docs/projection.md)."""
    from .sweep import default_sweep, projection_reason, published_sweep, run_sweep
    from .sweep_config import load_sweep, parse_sweep
    if project and measure:
        raise click.UsageError("--project and --measure contradict each other: give one")
    check_resume(resume, run_id, has_out=False)
    overrides = {k: v for k, v in (("model", model), ("device", device)) if v is not None}
    topo = {k: v for k, v in (("prefill_ranks", prefill_ranks), ("decode_ranks", decode_ranks)) if v is not None}

    def with_overrides(cfg):
        if not (overrides or topo):
            return cfg
        d = cfg.to_dict()
        d.update(overrides)
        d["topology"] = {**d["topology"], **topo}
        return parse_sweep(d, f"{cfg.source} (with command-line overrides)")
    cfg = with_overrides(load_sweep(sweep_file) if sweep_file is not None else default_sweep())
    from .ranks import from_env
    if sweep_file is None and not measure and not from_env().world > 1 and (project or any(
            n > 1 for n in topo.values())):
        # the tiny default has nothing to project: ranks beyond the launch ask for the published shape at those ranks
        shape = published_sweep(prefill_ranks, decode_ranks)
        cfg = parse_sweep({**shape, **overrides}, "<the published shape sweep>")
    reason = projection_reason(cfg, project, measure)
    if reason is not None:
        from .projection.sweep import run_projected_sweep
        click.echo(f"notice: {reason}")
        from .bench import OnError
        run_dir = run_projected_sweep(cfg, report_dir, run_id, resume, hardware, calibration,
                                      OnError(continue_on_error), echo=click.echo)
    elif hardware or calibration:
        raise click.UsageError("--hardware and --calibration set up a projection; this sweep is measured (add "
                               "--project to project it)")
    else:
        run_dir = run_sweep(cfg, report_dir, run_id, resume, continue_on_error, progress=not no_progress)
    if not from_env().main:                          # a torchrun launch: rank 0 reports
        return
    written = []
    if not no_report:
        from .report import report_run
        written = report_run(run_dir)
        if reason is not None:                       # the published charts (4 / 64 ranks) from every run's rows
            from .published_charts import write_published
            charts, missing = write_published(Path(report_dir), png=True)
            written += charts
            for line in missing:
                click.echo(line)
    rows = [r for r in _rows(run_dir) if r["status"] == "ok"]
    click.echo(f"{len(rows)} points in {run_dir}; " + (", ".join(p.name for p in written) if written else
                                                       f"no report: deepinfer-bench report {run_dir.name}"))
    for r in rows:
        if r["mode"] == "decode":
            click.echo(f"  {r['key']:<28} {_num(r['output_tput_per_gpu'], '9.1f')} out tok/s/GPU  "
                       f"{_num(r['median_intvty'], '8.1f')} tok/s/user  step: host {_num(r.get('host_ms'), '.2f')} "
                       f"ms, waits {_num(r.get('device_wait_ms'), '.2f')} ms")
        else:
            click.echo(f"  {r['key']:<28} {_num(r['input_tput_per_gpu'], '9.1f')} in tok/s/GPU   "
                       f"TTFT p99 {_num(r['p99_ttft'], '.3f')} s")
    click.echo(index_hint(report_dir, run_dir))


@cli.command("report", epilog="""Examples:

\b
  deepinfer-bench report 20250101-120000-tiny-cpu          # one run's summary.csv and charts, and the index
  deepinfer-bench report --all --no-png                   # every run under reports/, HTML and CSV only
  git add -f reports/1/RUN && deepinfer-bench report --all # publish a run: list it in reports/index.md
  deepinfer-bench report NEW --against OLD                  # NEW's charts, and NEW against OLD in one chart each
  deepinfer-bench report --published                      # reports/published/: prefill (4 ranks), decode (64)""")
@click.argument("run_ids", nargs=-1, callback=not_blank_each)
@click.option("--all", "all_runs", is_flag=True, help="every run under the report dir")
@report_dir_option()
@click.option("--no-png", is_flag=True, help="HTML and CSV only")
@click.option("--against", "against", multiple=True, callback=not_blank_each,
              help="an earlier run to chart the named run against (repeatable): <mode>_vs_<run>.html / .png")
@click.option("--published", is_flag=True,
              help="only the published charts, from every run's rows (or RUN_IDS'): <report dir>/published/")
@click.option("--prefill-ranks", type=Count(1), default=None,
              help="--published: the prefill chart's ranks [default: 4]")
@click.option("--decode-ranks", type=Count(1), default=None,
              help="--published: the decode chart's ranks [default: 64]")
def report_cmd(run_ids, all_runs, report_dir, no_png, against, published, prefill_ranks, decode_ranks) -> None:
    """Regenerate summary.csv and the Pareto charts of RUN_IDS (or --all) from their stored rows, and the index
    (reports/index.md: the only command that writes it). A corrupt row in a named run is an error before anything
    is written; with --all such a run is listed as unreadable. --published writes the published charts instead."""
    from deepinfer.errors import DeepInferError

    from .report import bench_table, comparison_charts, ok_rows, report_run, sweep_runs, write_index
    from .rows import CorruptRowError
    root = Path(report_dir)
    if not root.is_dir():
        raise DeepInferError(f"no report directory {root}: run a sweep first, or pass --report-dir")
    if all_runs and run_ids:
        raise click.UsageError(f"name RUN_IDS or pass --all, not both (got {', '.join(run_ids)} and --all)")
    if published:
        _report_published(root, run_ids, no_png, against, prefill_ranks, decode_ranks)
        return
    if prefill_ranks is not None or decode_ranks is not None:
        raise click.UsageError("--prefill-ranks and --decode-ranks choose the published charts' rows: add --published")
    if against and len(run_ids) != 1:
        raise click.UsageError("--against compares one named run with earlier ones: name exactly one RUN_ID")
    runs = sweep_runs(root)
    runs_all = runs
    missing = [r for r in against if not any(d.name == r for d in runs)]
    if missing:
        raise DeepInferError(f"--against: no stored rows for run(s) {missing} under {root}")
    if not all_runs:
        if not run_ids:
            raise click.UsageError("name RUN_IDS or pass --all")
        missing = [r for r in run_ids if not any(d.name == r for d in runs)]
        if missing:
            raise DeepInferError(f"no stored rows for run(s) {missing} under {root} (runs there: "
                                 f"{[d.name for d in runs][:10]})")
        runs = [d for d in runs if d.name in run_ids]
    loaded = {}
    for run_dir in runs:                 # every named run is read before anything is written
        try:
            loaded[run_dir] = ok_rows(run_dir)
        except CorruptRowError:
            if not all_runs:
                raise
    for run_dir, rows in loaded.items():   # with --all, the index names the unreadable ones (one warning each)
        table = [] if all_runs else bench_table(run_dir)     # a named bench run: its table, traffic included
        if rows:
            written = report_run(run_dir, png=not no_png, rows=rows)
            for other in (d for d in runs_all if d.name in against):
                written += comparison_charts(run_dir, rows, other, ok_rows(other), png=not no_png)
            click.echo(f"{run_dir}: " + ", ".join(p.name for p in written))
        elif not table:
            click.echo(f"{run_dir}: no sweep points (a check run or nothing finished): no charts")
        for line in ([f"{run_dir}: its table"] if table else []) + [f"  {line}" for line in table]:
            click.echo(line)
    click.echo(f"index: {write_index(root)}")


def _report_published(root: Path, run_ids, no_png, against, prefill_ranks, decode_ranks) -> None:
    """report --published: the two published charts and points.csv, from every run's rows (RUN_IDS: theirs)."""
    from .published_charts import DECODE_RANKS, PREFILL_RANKS, write_published
    if against:
        raise click.UsageError("--against charts one run against another; --published pools the runs: use one")
    written, missing = write_published(root, prefill_ranks or PREFILL_RANKS, decode_ranks or DECODE_RANKS,
                                       tuple(run_ids), png=not no_png)
    for line in missing:
        click.echo(line)
    if written:
        click.echo("published: " + ", ".join(str(p) for p in written))


@cli.command("step", epilog="""Example (one H200, bf16 V4 flash-width, 4 layers):

\b
  deepinfer-bench step --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16 \\
      --batch 1,16,64,256 --context 1024,8192 --prefill 8192
  deepinfer-bench step --model random:deepseek_v41:flash:4 --device cuda --dtype bfloat16 \\
      --expert-storage fp4 --batch 1,16,64,256 --context 1024,8192
  deepinfer-bench step --model random:deepseek_v41:flash:4 --device cuda --dtype bfloat16 \\
      --expert-storage fp4 --batch 1,16,64,256 --context 1024 --ep 1,2,8,64 --rank 0

Without options: the tiny V4 model on CPU, batches 1,8 at contexts 128,512 (seconds):

\b
  deepinfer-bench step --iters 5 --report-dir /tmp/reports""")
@model_option(None, "random:ARCH:PRESET:LAYERS, tiny, a checkpoint dir or hub id [default: random:deepseek_v4:tiny:4]")
@device_option()
@dtype_option()
@expert_storage_option()
@click.option("--kernel-backend", type=click.Choice(list(BACKEND_SETS)), default=None,
              help="kernel backend set [default: the engine's: DEEPINFER_KERNEL_BACKEND, else triton on CUDA "
                   "sm >= 8.9, else reference]")
@click.option("--batch", "batches", default=None, callback=not_blank,
              help="rows per decode step, comma-separated [default: 1,8]")
@click.option("--context", "contexts", default=None, callback=not_blank,
              help="positions already in each row's state, comma-separated [default: 128,512]")
@click.option("--query-len", type=Count(1), default=1, show_default=True,
              help="tokens per row (1: decode; > 1: verify-shaped rows)")
@click.option("--prefill", default=None, callback=not_blank,
              help="also prefill points: one row of T tokens from an empty state, comma-separated T (alone: prefill "
                   "points only)")
@click.option("--iters", type=Count(1), default=20, show_default=True, help="timed steps per point")
@click.option("--warmup", type=Count(0), default=3, show_default=True, help="untimed steps per point first")
@click.option("--trace-steps", type=Count(1), default=5, show_default=True, help="steps in the GPU idle trace")
@click.option("--no-graphs", is_flag=True, help="eager steps (the engine's enforce_eager)")
@click.option("--expert-act-quant", is_flag=True, help="W4A8 experts: FP8 activations per 1x128 (with fp4 storage)")
@click.option("--projection-storage", type=click.Choice(PROJECTION_STORAGE), default="dense", show_default=True,
              help="fp8: the release's FP8 projections stay FP8 and run fp8_linear (W8A8)")
@click.option("--kv-cache-dtype", type=click.Choice(KV_CACHE_DTYPES), default="auto", show_default=True,
              help="fp8: the release's FP8 / FP4 KV cache records (docs/kernels.md)")
@click.option("--ep", "ep_sizes", default=None, callback=not_blank,
              help="one-GPU rank views of expert parallelism, comma-separated EP sizes (1: the plain step): the "
                   "model holds one rank's experts and computes the pairs that rank would receive; the "
                   "all-to-all is counted, not run (docs/parallel.md)")
@click.option("--rank", "ep_rank", type=Count(0), default=0, show_default=True,
              help="which rank of each EP group the view is")
@click.option("--eplb-redundant", type=Count(0), default=0, show_default=True,
              help="EPLB: redundant expert slots per layer in the views, placed from the recorded routing")
@seed_option()
@run_dir_options("step", resume=True, continue_on_error=True)
def step_cmd(model, device, dtype, expert_storage, kernel_backend, batches, contexts, query_len, prefill, iters,
             warmup, trace_steps, no_graphs, expert_act_quant, projection_storage, kv_cache_dtype, ep_sizes, ep_rank,
             eplb_redundant, seed, report_dir, run_id, out, resume, continue_on_error) -> None:
    """Decode / verify / prefill step time against its roofline: one row per point (docs/bench.md).

    Per point: measured step time (CUDA events over graph replays on a GPU), the roofline from the bytes the
    step must read (dense weights, the experts its routing selects, state) and its FLOPs over copy bandwidth
    and GEMM peak measured in the same run, their ratio, and the GPU idle fraction between steps."""
    from .step_bench import DEFAULT_MODEL, StepConfig, run_step_bench, table
    check_resume(resume, run_id, out)
    pre = parse_int_list(prefill, "--prefill", example="1024,8192")
    b = parse_int_list(batches, "--batch")
    c = parse_int_list(contexts, "--context", minimum=0, example="1024,8192")
    if not pre or batches is not None or contexts is not None:
        b, c = b or (1, 8), c or (128, 512)
    cfg = StepConfig(model=model or DEFAULT_MODEL, device=device, dtype=dtype, expert_storage=expert_storage,
                     kernel_backend=kernel_backend, batches=b, contexts=c, query_len=query_len, prefill=pre,
                     iters=iters, warmup=warmup, trace_steps=trace_steps, graphs=not no_graphs, seed=seed,
                     expert_act_quant=expert_act_quant, projection_storage=projection_storage,
                     kv_cache_dtype=kv_cache_dtype, ep=parse_int_list(ep_sizes, "--ep", example="1,8,64"),
                     ep_rank=ep_rank, eplb_redundant=eplb_redundant)
    run_dir, rows = run_step_bench(cfg, report_dir, run_id, out, resume, continue_on_error, echo=click.echo)
    echo_rows(run_dir, table(rows))


@cli.command("kernels", epilog="""Examples (one H200):

\b
  deepinfer-bench kernels --device cuda                      # every op, shape, numerics, backend
  deepinfer-bench kernels --device cuda --op experts --model v41 --storage fp4 --tokens 1,64,8192
  deepinfer-bench kernels --device cpu --op experts --model v4 --storage fp4 --tokens 1 --experts-limit 8 \\
      --backend reference --iters 2                          # the reference on CPU (seconds)
  deepinfer-bench kernels --device cuda --op attention --tokens 1,16,64,256 --contexts 8192,32768""")
@device_option("cuda")
@click.option("--op", "ops", default=",".join(KOPS), show_default=True, callback=not_blank)
@click.option("--model", "models", default="v41,v4", show_default=True, callback=not_blank,
              help="released shapes of: v41 (384 x 5120 -> 2304 experts), v4 (256 x 4096 -> 2048)")
@click.option("--tokens", default="1,16,64,256,8192", show_default=True, callback=not_blank)
@click.option("--contexts", default="8192,32768,131072", show_default=True, callback=not_blank,
              help="attention rows: the context behind each query row")
@click.option("--storage", default="fp4,fp8,bf16", show_default=True, callback=not_blank,
              help="expert weight formats")
@click.option("--numerics", default="a16,a8", show_default=True, callback=not_blank,
              help="a16: activations in bf16 (W4A16 / W8A16); a8: FP8 per 1x128 (W4A8 / W8A8)")
@click.option("--backend", "backends", default="triton,triton_invariant", show_default=True, callback=not_blank)
@click.option("--no-reference", is_flag=True, help="skip timing the reference backend and the error against it")
@click.option("--experts-limit", type=Count(1), default=None, help="build only this many experts (small devices)")
@click.option("--iters", type=Count(1), default=20, show_default=True)
@click.option("--warmup", type=Count(0), default=3, show_default=True)
@seed_option()
@run_dir_options("kernels", resume=True)
def kernels_cmd(device, ops, models, tokens, contexts, storage, numerics, backends, no_reference, experts_limit,
                iters, warmup, seed, report_dir, run_id, out, resume) -> None:
    """Kernel rows: time, TB/s, TFLOP/s and their share of the ceilings measured in the same run, next to the
    torch reference (and cuBLAS for the dense GEMM), with the error against the reference (docs/bench.md)."""
    from .kernel_bench import KernelConfig, run_kernel_bench, table
    from .rows import run_dir_for
    check_resume(resume, run_id, out)
    names = lambda text, option, example: tuple(split_items(text, option, example))   # noqa: E731  checked below
    cfg = KernelConfig(device=device, ops=names(ops, "--op", "experts,attention"),
                       models=names(models, "--model", "v41,v4"), tokens=parse_int_list(tokens, "--tokens"),
                       contexts=parse_int_list(contexts, "--contexts", example="8192,32768"),
                       storage=names(storage, "--storage", "fp4,bf16"),
                       numerics=names(numerics, "--numerics", "a16,a8"),
                       backends=names(backends, "--backend", "triton,triton_invariant"),
                       iters=iters, warmup=warmup, seed=seed, check_reference=not no_reference,
                       experts_limit=experts_limit)
    run_dir = run_dir_for(report_dir, run_id, out, "kernels")
    rows = run_kernel_bench(cfg, run_dir, resume, echo=click.echo)
    echo_rows(run_dir, table(rows))


@cli.command("structured", epilog="""Examples:

\b
  deepinfer-bench structured --report-dir /tmp/reports              # tiny model on CPU (about a minute)
  deepinfer-bench structured --model random:deepseek_v41:flash:4 --device cuda --dtype bfloat16 \\
      --expert-storage fp4 --batch 1,16,64 --isl 256 --osl 128""")
@stacked(model_option("tiny"), device_option(), dtype_option(), expert_storage_option())
@click.option("--schemas", default="json,regex", show_default=True, callback=not_blank,
              help="the bench's grammars (harness/structured_bench.py SCHEMAS)")
@click.option("--batch", "batches", default="1,4,16", show_default=True, callback=not_blank,
              help="concurrencies, comma-separated")
@click.option("--fractions", default="0,0.5,1", show_default=True, callback=not_blank,
              help="share of each batch constrained")
@click.option("--isl", type=Count(1), default=64, show_default=True, help="prompt tokens")
@click.option("--osl", type=Count(1), default=64, show_default=True, help="most output tokens")
@click.option("--rounds", type=Count(1), default=2, show_default=True, help="timed requests per point = batch x rounds")
@seed_option()
@run_dir_options("structured")
def structured_cmd(model, device, dtype, expert_storage, schemas, batches, fractions, isl, osl, rounds, seed,
                   report_dir, run_id, out) -> None:
    """Structured outputs' cost: TPOT and throughput with 0 / 50 / 100% of each batch constrained (JSON schema,
    regex), one row per point, each set against the unconstrained baseline of its batch."""
    from .rows import run_dir_for
    from .structured_bench import SCHEMAS, StructuredConfig, parse_fractions, run_structured_bench, table
    cfg = StructuredConfig(model=model, device=device, dtype=dtype, expert_storage=expert_storage,
                           schemas=parse_names(schemas, "--schemas", tuple(SCHEMAS)),
                           batches=parse_int_list(batches, "--batch"), fractions=parse_fractions(fractions),
                           isl=isl, osl=osl, rounds=rounds, seed=seed)
    run_dir = run_dir_for(report_dir, run_id, out, "structured")
    rows = run_structured_bench(cfg, run_dir, echo=click.echo)
    echo_rows(run_dir, table(rows))


@cli.command("dspark", epilog="""Examples:

\b
  deepinfer-bench dspark --report-dir /tmp/reports                   # tiny V4.1 on CPU (about two minutes)
  deepinfer-bench dspark --model random:deepseek_v41:flash:4 --device cuda --dtype bfloat16 \\
      --expert-storage fp4 --modes off,fixed,confidence,budget --concurrency 1,16,60,96 --isl 1024 --osl 128
  deepinfer-bench dspark --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16 \\
      --num-speculative-tokens 3 --repeats 3                          # V4 drafting with its MTP layer
  deepinfer-bench dspark --model /path/to/DeepSeek-V4.1-Flash --acceptance measured --prompts all \\
      --device cuda --dtype bfloat16                                  # a real checkpoint, the prompt set""")
@model_option("random:deepseek_v41:tiny:2",
              "a checkpoint dir / hub id or random:ARCH:PRESET:N (V4.1 drafts with DSpark, V4 with its MTP layer)")
@stacked(device_option(), dtype_option(), expert_storage_option())
@click.option("--modes", default="off,fixed,confidence", show_default=True, callback=not_blank,
              help="off (no speculation), fixed, confidence, budget; comma-separated")
@click.option("--concurrency", default="1,4,16", show_default=True, callback=not_blank,
              help="concurrencies, comma-separated")
@click.option("--acceptance", default="v41-flash", show_default=True, callback=not_blank,
              help="pinned acceptance: a curve name (harness/dspark_bench.py CURVES), comma-separated survival "
                   "rates, or 'measured' (the drafter's own, for a real checkpoint)")
@click.option("--num-speculative-tokens", type=Count(1), default=5, show_default=True, help="drafts per step (<= 5)")
@click.option("--isl", type=Count(1), default=64, show_default=True, help="prompt tokens")
@click.option("--osl", type=Count(1), default=64, show_default=True,
              help="new tokens per request (exactly; with --prompts from the set: at most, ending at EOS)")
@click.option("--rounds", type=Count(1), default=2, show_default=True,
              help="timed requests per point = concurrency x rounds")
@seed_option()
@click.option("--prompts", type=click.Choice(["random", "all", "code", "math", "chat"]), default="random",
              show_default=True, help="random tokens, or a category of the project-owned prompt set (a real "
              "checkpoint's acceptance: chat template, cut to --isl, up to --osl new tokens ending at EOS)")
@click.option("--repeats", type=Count(1), default=1, show_default=True,
              help="run the study this many times, engines built afresh (the table: medians and ranges)")
@click.option("--one-engine", is_flag=True, help="hold one mode's engine at a time and run its points (a deep "
              "model's large points fit; the modes of a point are then minutes apart, not back to back)")
@click.option("--no-png", is_flag=True, help="chart as HTML only (no browser for kaleido)")
@run_dir_options("dspark")
def dspark_cmd(model, device, dtype, expert_storage, modes, concurrency, acceptance, num_speculative_tokens, isl,
               osl, rounds, seed, prompts, repeats, one_engine, report_dir, no_png, run_id, out) -> None:
    """DSpark speculative decoding against none, and confidence-scheduled verification against fixed-length:
    throughput, tok/s/user, accepted length and verified tokens per (mode, concurrency), acceptance pinned to a
    published curve by default (random weights accept almost nothing)."""
    from .dspark_bench import MODES, DSparkConfig, run_dspark_bench, table
    from .rows import run_dir_for
    cfg = DSparkConfig(model=model, device=device, dtype=dtype, expert_storage=expert_storage,
                       modes=parse_names(modes, "--modes", MODES),
                       concurrency=parse_int_list(concurrency, "--concurrency"), acceptance=acceptance,
                       num_speculative_tokens=num_speculative_tokens, isl=isl, osl=osl, rounds=rounds, seed=seed,
                       prompts=prompts, repeats=repeats, one_engine=one_engine)
    cfg.check()
    run_dir = run_dir_for(report_dir, run_id, out, "dspark")
    rows = run_dspark_bench(cfg, run_dir, echo=click.echo, png=not no_png)
    echo_rows(run_dir, table(rows))


@cli.command("versus", epilog="""Examples:

\b
  deepinfer-bench versus --report-dir /tmp/reports                   # tiny V4 on CPU (about a minute)
  deepinfer-bench versus --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16 \\
      --batch 1,64 --isl 1024 --osl 64""")
@model_option("random:deepseek_v4:tiny:4", "a deepseek_v4 checkpoint dir or random:deepseek_v4:PRESET:N")
@stacked(device_option(), dtype_option())
@click.option("--batch", "batches", default="1,64", show_default=True, callback=not_blank,
              help="batch sizes, comma-separated")
@click.option("--isl", type=Count(1), default=128, show_default=True, help="prompt tokens")
@click.option("--osl", type=Count(1), default=32, show_default=True, help="new tokens per prompt (exactly)")
@click.option("--engines", default=",".join(VERSUS_ENGINES), show_default=True, callback=not_blank,
              help="which of transformers, deepinfer (default kernels), reference (torch backend)")
@seed_option()
@run_dir_options("versus")
def versus_cmd(model, device, dtype, batches, isl, osl, engines, seed, report_dir, run_id, out) -> None:
    """deepinfer against transformers' eager generate and against its own torch reference backend on the same V4
    weights: one row per (engine, batch), greedy, the same prompts, exactly --osl new tokens each."""
    from .rows import run_dir_for
    from .versus_bench import VersusConfig, run_versus_bench, table
    cfg = VersusConfig(model=model, device=device, dtype=dtype, batches=parse_int_list(batches, "--batch"),
                       isl=isl, osl=osl, engines=parse_names(engines, "--engines", VERSUS_ENGINES), seed=seed)
    cfg.check()
    run_dir = run_dir_for(report_dir, run_id, out, "versus")
    rows = run_versus_bench(cfg, run_dir, echo=click.echo)
    echo_rows(run_dir, table(rows))


@cli.command("ops", epilog="""Examples:

\b
  deepinfer-bench ops                                  # the tiny V4.1, reference kernels, CPU (seconds)
  deepinfer-bench ops --model random:deepseek_v4:tiny:4 --top 60""")
@model_option("tiny", "dir, hub id, tiny or random:ARCH:PRESET:N (CPU: keep it small)")
@click.option("--kernel-backend", type=click.Choice(list(BACKEND_SETS)), default=None,
              help="kernel backend set [default: the engine's on the CPU: DEEPINFER_KERNEL_BACKEND, else reference; "
                   "invariant under DEEPINFER_BATCH_INVARIANT=1]")
@click.option("--batch", type=Count(1), default=4, show_default=True, help="sequences decoding together")
@click.option("--top", type=Count(1), default=40, show_default=True, help="source lines listed")
@click.option("--graph", is_flag=True, help="count the decode step a CUDA graph captures (one-row segments through "
                                            "the runner's static step) instead of the engine's eager decode steps")
def ops_cmd(model, kernel_backend, batch, top, graph) -> None:
    """Count a decode step's torch ops on the CPU by the engine source line that issues them (harness/op_census.py):
    what the model and the cache still launch outside the kernel ops, the list to fuse from."""
    from .op_census import build_census_engine, check_census, run_census, run_graph_census, table
    backend = check_census(model, kernel_backend, batch)          # before the model builds
    llm = build_census_engine(model, kernel_backend, batch)
    click.echo(f"kernel backend: {backend}" + (" (the graph-captured decode step)" if graph else ""))
    census = run_graph_census(llm, batch=batch) if graph else run_census(llm, batch=batch)
    for line in table(census, top):
        click.echo(line)


_check_options = stacked(
    model_option("tiny"), device_option(), dtype_option(),
    click.option("--max-tokens", type=Count(1), default=32, show_default=True),
    click.option("--prompt-len", type=Count(1), default=48, show_default=True),
    click.option("--mode", "modes", type=click.Choice(list(CHECK_MODES)), default=None,
                 help="batch-invariant mode off, on, or both [default: both; on only under "
                      "DEEPINFER_BATCH_INVARIANT=1]"),
    seed_option(), report_dir_option(), run_id_option("<time>-<check>"))


@cli.command("determinism", epilog="""Examples:

\b
  deepinfer-bench determinism --runs 8 --mode on           # tiny model on CPU, batch-invariant mode only
  deepinfer-bench determinism --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16""")
@_check_options
@click.option("--runs", type=Count(1), default=50, show_default=True, help="repetitions of the same prompts")
@click.option("--num-prompts", type=Count(1), default=8, show_default=True)
def determinism_cmd(runs, num_prompts, **kw) -> None:
    """The same prompts N times (greedy and seeded; shuffled, at changing concurrency): unique outputs per prompt
    and the first divergence."""
    _run_check("determinism", kw, runs=runs, num_prompts=num_prompts, trials=None)


@cli.command("batch-invariance", epilog="""Examples:

\b
  deepinfer-bench batch-invariance --trials 4              # tiny model on CPU, mode off and on
  deepinfer-bench batch-invariance --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16""")
@_check_options
@click.option("--trials", type=Count(1), default=20, show_default=True, help="batches the needle is placed in")
def batch_invariance_cmd(trials, **kw) -> None:
    """A needle prompt alone vs at random slots of random batches: tokens and logprobs compared bitwise."""
    _run_check("batch-invariance", kw, runs=None, num_prompts=1, trials=trials)


def _run_check(kind: str, kw: dict, runs: int | None, num_prompts: int, trials: int | None) -> None:
    from deepinfer.validate import check_device

    from .checks import check_modes, run_checks
    from .limits import POSITION_SLACK, Term, check_positions, model_limits
    from .bench import RunFolder
    from .rows import SCHEMA_VERSION, run_id_for
    from .sweep import build_llm
    from .sweep_config import parse_sweep
    from .workload import random_workload
    check_device(kw["device"])                # the counts are >= 1 already (their option type, Count(1))
    modes = check_modes(kw["modes"])
    max_len = kw["prompt_len"] * 2 + kw["max_tokens"] + POSITION_SLACK   # batch-invariance's fill prompts: longer
    cfg = parse_sweep({"name": kind, "model": kw["model"], "device": kw["device"], "dtype": kw["dtype"],
                       "engine_args": {"max_model_len": max_len, "max_num_seqs": 32},
                       "scenarios": [{"isl": kw["prompt_len"], "osl": kw["max_tokens"]}], "concurrency": [1],
                       "seed": kw["seed"]}, f"deepinfer-bench {kind}")
    check_positions(kw["model"], model_limits(kw["model"]),
                    [Term("--prompt-len", kw["prompt_len"], per=2), Term("--max-tokens", kw["max_tokens"])],
                    reserved=POSITION_SLACK)
    run_dir = Path(kw["report_dir"]) / SCHEMA_VERSION / run_id_for(kw["run_id"], kind)
    RunFolder(run_dir, None, resumable=False).check()
    llm = build_llm(cfg)                      # a bad model fails here, before the run directory is made
    prompts = random_workload(num_prompts, kw["prompt_len"], 1, 0.5, llm.model.cfg.vocab_size, kw["seed"]).prompts
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


cli.add_command(projection)          # deepinfer-bench projection validate (harness/cli_projection.py)
cli.add_command(plan_cmd)            # deepinfer-bench plan (harness/cli_projection.py)


def main() -> None:
    run_cli(cli)
