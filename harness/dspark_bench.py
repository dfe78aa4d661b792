"""`deepinfer-bench dspark`: what DSpark speculative decoding buys, and what confidence-scheduled verification
buys over fixed-length verification. One row per (mode, concurrency) point (docs/speculative.md); rows are decode
rows of the sweep's form (`schedule` the mode, `spec_mode` none / <method>-<schedule>-<drafts>), so the report draws a frontier per spec_mode. A V4 model
drafts with its MTP layer instead of DSpark stages (method mtp); everything else is the same study.

Modes: `off` (no speculation: the per-user baseline), `fixed` (every one of the N drafts verified: the comparison
mode), `confidence` (Algorithm 1 over the profiled step rate), `budget` (the production variant). One model is
built; each mode gets an engine of its own over it (its state pools, graphs and step-rate profile).

Random weights accept almost nothing, so by default acceptance is *pinned* (engine/speculative/pinned.py): a published
golden curve's per-position survival decides which drafts pass, while the real kernels draft, verify and roll
back the real shapes. `--acceptance measured` uses the drafter's own acceptance (a real checkpoint).

Per point: concurrency x rounds prompts, all ready at the start: by default random-token prompts of `isl` tokens
and exactly `osl` new tokens each (greedy, ignore_eos); with `prompts` a category of the project-owned prompt set
(harness/data/dspark_prompts.jsonl: code, math, chat; `all` cycles every category) the set's prompts through the
checkpoint's chat template (the plain text where it has none), cut to their last `isl` tokens, at most `osl` new
tokens each, ending at EOS (what a real checkpoint's acceptance is measured on). The point's workload first runs
once untimed (there is no prefix cache, so a repeated prompt costs what a new one does), then timed; a timed pass
that captured a new CUDA graph (variable verify lengths meet new shapes) is warm-up too and is run again, at most
TIMED_ATTEMPTS times (engine_stats: timed_attempts, and the graphs the last one captured, graphs_captured_timed).
Every repeat builds an engine per mode, and the modes of a point run back to back, so drift over the run falls on
all modes alike.
The row holds the client metrics (harness/metrics.py: output throughput, TPOT, tok/s/user) and the speculation
counters: mean accepted length (committed tokens per decode / verify row, bonus included), drafts verified per
row, acceptance by draft position, verify rows, steps, graph replays, and the step-rate table the schedule used.
`repeats` runs the whole study that many times, every engine built afresh each time (rows carry `repeat`; the
table gives the median and the range over the repeats: single runs differ between engines by more than the
schedules do, docs/speculative.md)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer import SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.validate import check_device, parse_dtype

from .bench import OnError, RunFolder, error_text, first_line, json_text, record_point
from .limits import (POSITION_SLACK, Term, check_concurrency, check_model, check_positions, default_step_budget,
                     model_limits)
from .metrics import compute_metrics
from .options import check_distinct, check_names, parse_decimal_list
from .traffic import TRAFFIC_HEADER, traffic_cell, traffic_fields
from .rows import environment, identity, kernel_fields, read_rows, run_dir_guard
from .workload import random_workload, run_requests

DSPARK_METHOD_VERSION = "2"
PROMPT_SETS = ("random", "all", "code", "math", "chat")
PROMPT_FILE = Path(__file__).parent / "data" / "dspark_prompts.jsonl"
TIMED_ATTEMPTS = 4                     # a timed pass that captured a CUDA graph is run again, at most this often
MODES = ("off", "fixed", "confidence", "budget")
# Published acceptance as per-position survival s_k (the chance drafts 1..k all pass; 5-token AL = 1 + sum).
# V4-Pro: InferenceX golden_al_distribution dsv4_dspark_probabilistic (B300, SPEED-Bench coding, T=1): s_k is
# AL(k) - AL(k-1) of its per-k curve. V4.1-Flash: only its 5-token AL is published (3.51, thinking on), so its
# curve is V4-Pro's thinking-on shape scaled to that AL.
CURVES = {
    "v41-flash": (0.788, 0.632, 0.485, 0.321, 0.284),
    "v4-pro-thinking": (0.86, 0.69, 0.53, 0.35, 0.31),
    "v4-pro-nothink": (0.93, 0.83, 0.71, 0.63, 0.42),
}


@dataclass(frozen=True)
class DSparkConfig:
    model: str = "random:deepseek_v41:tiny:2"
    device: str = "cpu"
    dtype: str = "float32"
    expert_storage: str = "dense"
    modes: tuple[str, ...] = ("off", "fixed", "confidence")
    concurrency: tuple[int, ...] = (1, 4, 16)
    acceptance: str = "v41-flash"          # a CURVES name, "measured", or comma-separated survival rates
    num_speculative_tokens: int = 5
    isl: int = 64
    osl: int = 64
    rounds: int = 2
    seed: int = 0
    prompts: str = "random"                # PROMPT_SETS: random tokens, or a category of the prompt set
    repeats: int = 1
    one_engine: bool = False               # one mode's engine held at a time (a deep model's large points fit)

    def survival(self) -> tuple[float, ...] | None:
        """The pinned survival curve (None: measured acceptance)."""
        if self.acceptance == "measured":
            return None
        if self.acceptance in CURVES:
            return CURVES[self.acceptance]
        try:                                  # survival rates may repeat (a flat curve): no distinct rule
            return parse_decimal_list(self.acceptance, "--acceptance", "0.8,0.6,0.45", noun="survival rates",
                                      distinct=False)
        except DeepInferError:
            raise DeepInferError(f"--acceptance {self.acceptance!r}: give one of {', '.join(CURVES)}, 'measured' "
                                 f"or comma-separated survival rates as plain decimals (e.g. 0.8,0.6,0.45,0.3,0.25)") \
                from None

    def check(self) -> None:
        """Every option, then what they become as engine arguments (max_num_seqs = the largest concurrency,
        max_model_len = isl + osl + drafts + 8) against the engine's step budget and the model's positions, before
        anything is built."""
        check_names("--modes", self.modes, MODES)
        check_distinct("--concurrency", self.concurrency)
        if self.prompts not in PROMPT_SETS:
            raise DeepInferError(f"--prompts {self.prompts!r}: choose from {', '.join(PROMPT_SETS)}")
        for name, v in (("--isl", self.isl), ("--osl", self.osl), ("--rounds", self.rounds),
                        ("--num-speculative-tokens", self.num_speculative_tokens), ("--repeats", self.repeats)):
            if v < 1:
                raise DeepInferError(f"{name} must be at least 1, got {v}")
        if self.osl < 2:
            raise DeepInferError("--osl must be at least 2 (TPOT needs two tokens)")
        from deepinfer.speculative.config import speculative_config
        from deepinfer.env import read
        from deepinfer.validate import drafter_of_spec
        switches = [k for k in ("DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_ENABLE_MTP_VARLEN") if read(k)]
        if switches:                          # each mode sets speculation itself: the switches would contradict it
            raise DeepInferError(f"deepinfer-bench dspark sets speculative decoding per mode (--modes, "
                                 f"--num-speculative-tokens); {' and '.join(switches)} would contradict it: unset "
                                 f"{'them' if len(switches) > 1 else 'it'}")
        for mode in self.modes:               # the engine's own checks (drafts, curve), before anything is built
            speculative_config(self.speculative(mode), 5, drafter_of_spec(self.model))
        check_concurrency("--concurrency", self.concurrency, default_step_budget())
        check_positions(self.model, model_limits(self.model), [
            Term("--isl", self.isl), Term("--osl", self.osl, minimum=2),
            Term("--num-speculative-tokens", self.num_speculative_tokens)], reserved=POSITION_SLACK)

    def speculative(self, mode: str):
        """The engine's `speculative` argument for a mode (False: off)."""
        if mode == "off":
            return False
        spec = {"schedule": mode, "num_speculative_tokens": self.num_speculative_tokens}
        survival = self.survival()
        if survival is not None:
            spec["acceptance"] = list(survival)
        return spec


def key(mode: str, concurrency: int, repeat: int | None = None) -> str:
    return f"{mode}/c{concurrency}" + ("" if repeat is None else f"/r{repeat}")


def set_prompts(llm, category: str, n: int, isl: int) -> list[list[int]]:
    """n prompts of the project-owned set (category or `all`), cycled, as token ids through the chat template (the
    plain text without one), each cut to its last isl tokens."""
    if llm.tokenizer is None:
        raise DeepInferError("--prompts needs the checkpoint's tokenizer (the model has none): use --prompts random")
    texts = [json.loads(line) for line in PROMPT_FILE.read_text().splitlines() if line.strip()]
    texts = [t["prompt"] for t in texts if category == "all" or t["category"] == category]
    try:
        llm.chat_template()
        encode = lambda t: llm.encode_chat([{"role": "user", "content": t}])   # noqa: E731
    except DeepInferError:                                   # no chat template: the plain text
        encode = lambda t: llm.tokenizer.encode(t).ids       # noqa: E731
    ids = [encode(t)[-isl:] for t in texts]
    return [ids[i % len(ids)] for i in range(n)]


def point_workload(llm, cfg: "DSparkConfig", n: int, seed: int):
    """(prompts, SamplingParams) of one pass of a point: random tokens (exactly osl new) or the prompt set."""
    if cfg.prompts == "random":
        work = random_workload(n, cfg.isl, cfg.osl, 1.0, llm.model.cfg.vocab_size, seed)
        return work.prompts, SamplingParams(temperature=0, max_tokens=cfg.osl, ignore_eos=True)
    prompts = set_prompts(llm, cfg.prompts, n + seed % 7, cfg.isl)[seed % 7:]   # each point starts elsewhere
    return prompts, SamplingParams(temperature=0, max_tokens=cfg.osl)


def speculation_fields(stats, policy) -> dict:
    """The speculation counters of a point (EngineStats since reset) as row fields."""
    rows = stats.decode_rows
    by_pos = [a / d if d else None for a, d in zip(stats.accepted_at, stats.drafts_at)]
    return {"decode_rows": rows, "verify_rows": stats.drafts_at[0] if stats.drafts_at else 0,
            "draft_tokens": stats.draft_tokens, "accepted_draft_tokens": stats.accepted_draft_tokens,
            "mean_accepted_length": stats.decode_row_tokens / rows if rows else None,
            "drafts_verified_per_row": stats.draft_tokens / rows if rows else None,
            "verified_tokens_per_row": (stats.draft_tokens + rows) / rows if rows else None,
            "draft_acceptance": stats.accepted_draft_tokens / stats.draft_tokens if stats.draft_tokens else None,
            "acceptance_by_position": by_pos, "drafts_by_position": list(stats.drafts_at),
            "rollbacks": stats.rollbacks,
            "step_rate": None if policy is None or policy.table is None else policy.table.to_dict(),
            "step_overhead": None if policy is None or not policy.calibrate else policy.overhead,
            "drafts_filled": None if policy is None else policy.filled,
            "step_times": None if policy is None else policy.step_times()}


def measure_point(llm, cfg: DSparkConfig, concurrency: int, index: int) -> dict:
    """One warm-up pass of the point's own workload, then timed passes of it until one captures no new CUDA
    graph (at most TIMED_ATTEMPTS; a pass that captured is warm-up too). The row says how many it took and what
    the last one captured."""
    n = concurrency * cfg.rounds
    prompts, params = point_workload(llm, cfg, n, cfg.seed * 1_000_003 + index)
    run_requests(llm, prompts, [params] * n, concurrency)
    for attempt in range(1, TIMED_ATTEMPTS + 1):
        captured = len(llm.stats.graphs_captured)
        llm.engine.reset_stats()
        _, timings, duration = run_requests(llm, prompts, [params] * n, concurrency)
        if len(llm.stats.graphs_captured) == captured:
            break
    row = compute_metrics(timings, duration=duration, num_gpus=1).to_row()
    st = llm.stats
    row.update(speculation_fields(st, llm.engine.speculation and llm.engine.speculation.policy))
    row.update(traffic_fields(st))
    row["engine_stats"] = {"steps": st.steps, "graph_replays": st.graph_replays,
                           "graphs_captured": len(st.graphs_captured),
                           "graphs_captured_timed": len(st.graphs_captured) - captured,
                           "timed_attempts": attempt, "fed_tokens": st.fed_tokens,
                           "committed_tokens": st.committed_tokens, "max_step_tokens": st.max_step_tokens}
    return row


def _engine(model, cfg: DSparkConfig, mode: str):
    from deepinfer import LLM
    return LLM(model=model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, expert_storage=cfg.expert_storage,
               max_model_len=cfg.isl + cfg.osl + cfg.num_speculative_tokens + POSITION_SLACK,
               max_num_seqs=max(cfg.concurrency),
               speculative=cfg.speculative(mode), expert_traffic=True)


def _point_row(llm, cfg: DSparkConfig, store, identity: dict, mode: str, c: int, index: int, rep: int,
               echo) -> dict:
    """One point's row; a point that runs out of device memory or is refused is a failure row and the study goes
    on (the next concurrency may fit)."""
    import torch

    from .sweep import free_device_memory, spec_mode_of

    def describe(e: BaseException) -> str:
        if not isinstance(e, torch.OutOfMemoryError):
            return error_text(e)
        first = first_line(str(e)) or "CUDA out of memory"     # every mode's engine is held at once by default
        return (f"out of device memory at concurrency {c} ({first[:120]}); every mode's engine is held at once: "
                f"--one-engine, fewer --modes or a lower --concurrency")
    fields = {"schedule": mode, "spec_mode": spec_mode_of(llm), "mode": "decode", "engine": "deepinfer", "gpus": 1,
              "num_prompts": c * cfg.rounds, "concurrency": c, "repeat": rep, **kernel_fields(llm)}
    on_error = OnError(keep_going=(DeepInferError, torch.OutOfMemoryError), describe=describe,
                       rerun="rerun into a new run directory (--run-id / --out)")
    row = record_point(store, identity, key(mode, c, rep if cfg.repeats > 1 else None), fields,
                       lambda: measure_point(llm, cfg, c, index), on_error, echo)
    if row["status"] == "failed":
        free_device_memory()                   # outside the handler: its traceback no longer holds the tensors
    else:
        echo(f"  {row['key']:<14} {row['output_throughput']:9.1f} tok/s  {row['median_intvty']:8.1f} tok/s/user  "
             f"AL {row['mean_accepted_length']:.3f}")
    return row


def build_draft_model(cfg: DSparkConfig):
    """The study's one model (every mode's engine runs over it); one line when it cannot draft."""
    from deepinfer.api import resolve_model
    model = resolve_model(cfg.model, cfg.device, cfg.dtype, cfg.expert_storage)
    if model.drafting is None:
        raise DeepInferError(f"--model {cfg.model} cannot draft (no DSpark stages or NextN layer: "
                             f"num_nextn_predict_layers = 0): docs/speculative.md")
    return model


def run_dspark_bench(cfg: DSparkConfig, run_dir: Path, echo=None, png: bool = True) -> list[dict]:
    """Every point into run_dir/rows.jsonl (a new run: a directory with rows is refused), then the run's report
    (summary.csv and the decode Pareto chart, as `deepinfer-bench report` regenerates them); returns the rows."""
    from .sweep import free_device_memory
    echo = echo or (lambda s: None)
    cfg.check()
    check_device(cfg.device)
    parse_dtype(cfg.dtype)
    check_model(cfg.model, cfg.expert_storage)
    folder = RunFolder(run_dir, "dspark.json", resumable=False)
    folder.check()
    t0 = time.perf_counter()
    model = build_draft_model(cfg)
    echo(f"model built in {time.perf_counter() - t0:.1f} s; {len(cfg.modes) * len(cfg.concurrency)} points")
    with run_dir_guard(run_dir):
        env = environment()
        store = folder.open(json_text(asdict(cfg)))
        survival = cfg.survival()
        ident = identity(env, DSPARK_METHOD_VERSION, bench="dspark", run_id=run_dir.name, model=cfg.model,
                         model_type=model.cfg.model_type, precision=cfg.dtype, device=cfg.device,
                         expert_storage=cfg.expert_storage, isl=cfg.isl, osl=cfg.osl,
                         pinned_survival=None if survival is None else list(survival),
                         num_speculative_tokens=cfg.num_speculative_tokens, is_projected=False, rounds=cfg.rounds,
                         seed=cfg.seed, acceptance=cfg.acceptance, prompts=cfg.prompts, repeats=cfg.repeats,
                         engines_held=1 if cfg.one_engine else len(cfg.modes))
        # Every mode's engine afresh each repeat. By default all of them are held and the modes of a point run
        # back to back (drift between them stays small); --one-engine runs one mode's points at a time, so a deep
        # model's largest points fit beside one engine's pools and graphs instead of every mode's.
        groups = [[m] for m in cfg.modes] if cfg.one_engine else [list(cfg.modes)]
        for rep in range(cfg.repeats):
            for group in groups:
                engines = {}
                for mode in group:
                    t1 = time.perf_counter()
                    engines[mode] = _engine(model, cfg, mode)
                    echo(f"{mode}: engine built in {time.perf_counter() - t1:.1f} s")
                for index, c in enumerate(cfg.concurrency):      # every mode and repeat: the same workloads
                    for mode, llm in engines.items():
                        _point_row(llm, cfg, store, ident, mode, c, index, rep, echo)
                llm = None
                engines.clear()                  # their pools and graphs go back before the next engines'
                free_device_memory()
    from .report import report_run
    report_run(run_dir, png=png)               # summary.csv, decode_pareto: a frontier per spec_mode
    return read_rows(run_dir)


def _median(values: list):
    import statistics
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fixed_verified_at(al: float | None, survival: list | None) -> float | None:
    """Verified tokens per row (drafts + 1) that fixed-length verification needs for accepted length `al`, from
    fixed's measured survival s_1..s_n (AL(k) = 1 + s_1 + .. + s_k; linear between whole k: verifying draft k+1
    on a share f of the rows adds f x s_{k+1}). None when `al` is above what all n drafts reach."""
    if al is None or not survival:
        return None
    reached, k = 1.0, 0
    for s in survival:
        if s is None or s <= 0 or al <= reached:
            break
        if al <= reached + s:
            return 1 + k + (al - reached) / s
        reached, k = reached + s, k + 1
    return 1.0 + k if al <= reached + 1e-9 else None


def table(rows: list[dict]) -> list[str]:
    """Per concurrency and mode (the median over repeats; with repeats, the throughput's and tok/s/user's range
    as min-max): throughput, tok/s/user, accepted length, verified tokens per row, and the ratios the upstream
    claims are about: tok/s/user against `off`, and for confidence / budget the verified tokens, accepted length
    and throughput against `fixed` (ratios of medians), and the verified tokens against what fixed-length
    verification needs for the same accepted length (`@AL`: fixed_verified_at over fixed's measured survival)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok":
            groups.setdefault((r["schedule"], r["concurrency"]), []).append(r)
    fields = ("output_throughput", "median_intvty", "mean_accepted_length", "verified_tokens_per_row")
    ok = {k: {f: _median([r[f] for r in g]) for f in fields} | {"traffic": traffic_cell(g[-1])}
          for k, g in groups.items()}
    for (mode, _), g in groups.items():
        if mode == "fixed":                 # fixed's survival by draft position (the median over repeats)
            ok[mode, _]["survival"] = [_median(list(s)) for s in zip(*(r["acceptance_by_position"] for r in g))]
    spread = {k: {f: (min(r[f] for r in g), max(r[f] for r in g)) for f in fields[:2]}
              for k, g in groups.items() if len(g) > 1}
    lines = [f"{'conc':>5} {'mode':<10} {'tok/s':>9} {'tok/s/u':>8} {'AL':>6} {'verif/row':>9} "
             f"{'u vs off':>8} {'verif vs fix':>12} {'AL vs fix':>9} {'tput vs fix':>11} {'verif vs fix@AL':>15} "
             f"{TRAFFIC_HEADER}"
             + ("  tok/s range; tok/s/u range" if spread else "")]
    fmt = lambda v, f: "-" if v is None else format(v, f)                 # noqa: E731
    ratio = lambda a, b: a / b if a is not None and b else None           # noqa: E731
    for (mode, c), r in sorted(ok.items(), key=lambda kv: (kv[0][1], MODES.index(kv[0][0]))):
        off, fix = ok.get(("off", c)), ok.get(("fixed", c))
        vs_fix = mode in ("confidence", "budget") and fix is not None
        rng = spread.get((mode, c))
        at_al = fixed_verified_at(r["mean_accepted_length"], fix.get("survival")) if vs_fix else None
        lines.append(
            f"{c:>5} {mode:<10} {r['output_throughput']:>9.1f} {r['median_intvty']:>8.1f} "
            f"{fmt(r['mean_accepted_length'], '.3f'):>6} {fmt(r['verified_tokens_per_row'], '.3f'):>9} "
            f"{fmt(ratio(r['median_intvty'], off['median_intvty']) if off and mode != 'off' else None, '.3f'):>8} "
            f"{fmt(ratio(r['verified_tokens_per_row'], fix['verified_tokens_per_row']) if vs_fix else None, '.3f'):>12} "
            f"{fmt(ratio(r['mean_accepted_length'], fix['mean_accepted_length']) if vs_fix else None, '.3f'):>9} "
            f"{fmt(ratio(r['output_throughput'], fix['output_throughput']) if vs_fix else None, '.3f'):>11} "
            f"{fmt(ratio(r['verified_tokens_per_row'], at_al), '.3f'):>15} {r['traffic']:<24}"
            + (f"  {rng['output_throughput'][0]:.1f}-{rng['output_throughput'][1]:.1f}; "
               f"{rng['median_intvty'][0]:.1f}-{rng['median_intvty'][1]:.1f}" if rng else ""))
    return lines
