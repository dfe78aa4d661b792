"""`deepinfer-bench structured`: what structured outputs cost the decode loop. One row per (schema, batch,
constrained fraction) point (docs/structured-outputs.md).

Per point: batch x rounds random-token prompts of `isl` tokens run at concurrency = batch (all ready at the start,
as the sweep's decode points); in every group of `batch` consecutive requests the first round(fraction x batch)
carry so_args of the schema (max_tokens = osl, they may end earlier when the grammar completes), the rest are free
(ignore_eos, exactly osl tokens); round half up, and a fraction whose count repeats another's at a batch is skipped
there (rows: constrained_fraction, the share that ran). The same number of other prompts first, untimed (every graph
shape captured, kernels compiled, the grammar compiled: with a one-round warm-up, first calls stall a large point
for seconds). The row holds the client metrics of harness/metrics.py over all requests, TPOT split into constrained
and free requests, output tokens and finish reasons per class, and how many constrained outputs that ended "stop"
parse (json: json.loads + the jsonschema package when installed; regex: fullmatch), and the host time of the steps'
mask fills (engine.mask_fill_ms_per_fill).
Fraction 0 is one baseline per batch (key none/b{batch}/f0), shared by the schemas; the table sets each
point's TPOT against it."""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from deepinfer import SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.validate import check_device, parse_dtype

from .bench import OnError, RunFolder, json_text, record_point
from .limits import (POSITION_SLACK, Term, check_concurrency, check_model, check_positions, default_step_budget,
                     model_limits)
from .metrics import compute_metrics
from .options import check_distinct, check_names, parse_decimal_list
from .traffic import TRAFFIC_HEADER, traffic_cell, traffic_fields
from .rows import environment, identity, kernel_fields, read_rows, run_dir_guard
from .workload import random_workload, run_requests

STRUCTURED_METHOD_VERSION = "1"
# The bench's grammars: open-ended ones (a random model rarely completes them early), with the large legal
# token sets of free text inside JSON strings / the regex's words: the expensive case for the mask.
SCHEMAS = {
    "json": {"type": "object", "required": ["name", "tags", "score"], "additionalProperties": False,
             "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                            "tags": {"type": "array", "items": {"type": "string"}}}},
    "regex": r"([a-z]+[ ,.])+",
}


@dataclass(frozen=True)
class StructuredConfig:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    expert_storage: str = "dense"
    schemas: tuple[str, ...] = ("json", "regex")
    batches: tuple[int, ...] = (1, 4, 16)
    fractions: tuple[float, ...] = (0.0, 0.5, 1.0)
    isl: int = 64
    osl: int = 64
    rounds: int = 2
    seed: int = 0

    def points(self) -> list[tuple[str, int, float]]:
        """(schema or "none", batch, fraction): the fraction-0 baseline once per batch, first. A fraction is the
        share of a batch constrained, constrained(fraction, batch) requests of it; a fraction whose count repeats
        a smaller fraction's (0.5 of batch 1 is 1 request, as 1.0 is; 0.1 of batch 4 is none) is skipped at that
        batch, so no point is a copy of another under a different label."""
        out = []
        for b in self.batches:
            if 0.0 in self.fractions:
                out.append(("none", b, 0.0))
            seen, fracs = {0}, []
            for f in sorted(self.fractions, reverse=True):       # the largest fraction keeps a repeated count
                if constrained(f, b) not in seen:
                    seen.add(constrained(f, b))
                    fracs.append(f)
            out += [(s, b, f) for s in self.schemas for f in sorted(fracs)]
        return out

    def check(self) -> None:
        """Every option, then what they become as engine arguments (max_num_seqs = the largest batch,
        max_model_len = isl + osl + POSITION_SLACK) against the engine's step budget and the model's positions,
        before anything is built."""
        check_names("--schemas", self.schemas, tuple(SCHEMAS))
        bad = [f for f in self.fractions if not 0 <= f <= 1]
        if bad or not self.fractions:
            raise DeepInferError(f"--fractions: give fractions in [0, 1], e.g. 0,0.5,1 (got {bad or 'none'})")
        check_distinct("--fractions", self.fractions)
        check_distinct("--batch", self.batches)
        for name, v in (("--isl", self.isl), ("--osl", self.osl), ("--rounds", self.rounds)):
            if v < 1:
                raise DeepInferError(f"{name} must be at least 1, got {v}")
        if self.osl < 2:
            raise DeepInferError("--osl must be at least 2 (TPOT needs two tokens)")
        check_concurrency("--batch", self.batches, default_step_budget())
        check_positions(self.model, model_limits(self.model),
                        [Term("--isl", self.isl), Term("--osl", self.osl, minimum=2)], reserved=POSITION_SLACK)


def constrained(fraction: float, batch: int) -> int:
    """Requests of a batch that carry the grammar: fraction x batch rounded half up."""
    return math.floor(fraction * batch + 0.5)


def key(schema: str, batch: int, fraction: float) -> str:
    return f"{schema}/b{batch}/f{fraction:g}"


def parse_fractions(text: str) -> tuple[float, ...]:
    """'0,0.5,1' -> (0.0, 0.5, 1.0): distinct plain decimals (their range: StructuredConfig.check)."""
    return parse_decimal_list(text, "--fractions", "0,0.5,1", noun="fractions")


def output_parses(schema: str, text: str) -> bool:
    """A constrained output that ended "stop" is in its grammar's language (json: the eval's json_valid)."""
    from deepinfer.evals.tasks.metrics import json_record
    if schema == "regex":
        return re.fullmatch(SCHEMAS["regex"], text) is not None
    return json_record({}, [text], SCHEMAS["json"])["json_valid"] == 1.0


def _params(cfg: StructuredConfig, schema: str, batch: int, fraction: float, n: int) -> list[SamplingParams]:
    k = constrained(fraction, batch)
    so = None if schema == "none" else {"schema_type": schema, "schema": SCHEMAS[schema]}
    return [SamplingParams(temperature=0, max_tokens=cfg.osl, so_args=so) if i % batch < k and so else
            SamplingParams(temperature=0, max_tokens=cfg.osl, ignore_eos=True) for i in range(n)]


def measure_point(llm, cfg: StructuredConfig, schema: str, batch: int, fraction: float, index: int) -> dict:
    vocab = llm.model.cfg.vocab_size
    n = batch * cfg.rounds
    work = random_workload(n, cfg.isl, cfg.osl, 1.0, vocab, cfg.seed * 1_000_003 + index)
    warm = random_workload(n, cfg.isl, cfg.osl, 1.0, vocab, cfg.seed * 1_000_003 + index + 7919)
    params = _params(cfg, schema, batch, fraction, n)
    run_requests(llm, warm.prompts, params, batch)
    llm.engine.reset_stats()
    masks0 = llm.grammar_mask_stats
    outs, timings, duration = run_requests(llm, work.prompts, params, batch)
    masks1 = llm.grammar_mask_stats
    row = compute_metrics(timings, duration=duration).to_row()
    for cls, pick in (("constrained", lambda sp: sp.so_args is not None), ("free", lambda sp: sp.so_args is None)):
        idx = [i for i, sp in enumerate(params) if pick(sp)]
        tpot = compute_metrics([timings[i] for i in idx], duration=duration).tpot if idx else None
        row[f"{cls}_requests"] = len(idx)
        row[f"{cls}_mean_tpot"] = tpot.mean if tpot is not None and tpot.count else None
        row[f"{cls}_mean_output_tokens"] = sum(timings[i].output_tokens for i in idx) / len(idx) if idx else None
        reasons: dict[str, int] = {}
        for i in idx:
            r = outs[i].outputs[0].finish_reason
            reasons[r] = reasons.get(r, 0) + 1
        row[f"{cls}_finish_reasons"] = reasons
    stopped = [outs[i].outputs[0].text for i, sp in enumerate(params)
               if sp.so_args is not None and outs[i].outputs[0].finish_reason == "stop"]
    row["constrained_fraction"] = constrained(fraction, batch) / batch
    row["constrained_stopped"] = len(stopped)
    row["constrained_stopped_parse"] = sum(output_parses(schema, t) for t in stopped)
    st = llm.stats
    row.update(traffic_fields(st))
    fills = masks1["fills"] - masks0["fills"]
    row["engine"] = {"steps": st.steps, "graph_replays": st.graph_replays, "async_scheduling": st.async_scheduling,
                     "mask_fills": fills, "mask_fill_ms_per_fill":
                     (masks1["fill_seconds"] - masks0["fill_seconds"]) * 1e3 / fills if fills else None}
    return row


def run_structured_bench(cfg: StructuredConfig, run_dir: Path, echo=None) -> list[dict]:
    """Every point into run_dir/rows.jsonl (a new run: a directory with rows is refused); returns the rows."""
    from .sweep import build_llm
    from .sweep_config import parse_sweep
    echo = echo or (lambda s: None)
    cfg.check()
    check_device(cfg.device)
    parse_dtype(cfg.dtype)
    check_model(cfg.model, cfg.expert_storage)
    folder = RunFolder(run_dir, "structured.json", resumable=False)
    folder.check()
    max_len = cfg.isl + cfg.osl + POSITION_SLACK
    sweep = parse_sweep({"name": "structured", "model": cfg.model, "device": cfg.device, "dtype": cfg.dtype,
                         "engine_args": {"max_model_len": max_len, "max_num_seqs": max(cfg.batches),
                                         "expert_storage": cfg.expert_storage},
                         "scenarios": [{"isl": cfg.isl, "osl": cfg.osl}], "concurrency": [1], "seed": cfg.seed},
                        "deepinfer-bench structured")
    t0 = time.perf_counter()
    llm = build_llm(sweep)
    echo(f"engine built in {time.perf_counter() - t0:.1f} s; {len(cfg.points())} points")
    on_error = OnError(rerun="rerun into a new run directory (--run-id / --out)")
    with run_dir_guard(run_dir):
        env = environment()
        store = folder.open(json_text(asdict(cfg)))
        ident = identity(env, STRUCTURED_METHOD_VERSION, bench="structured", run_id=run_dir.name, model=cfg.model,
                         model_type=llm.model.cfg.model_type, precision=cfg.dtype, device=cfg.device,
                         **kernel_fields(llm), isl=cfg.isl, osl=cfg.osl, rounds=cfg.rounds, seed=cfg.seed)
        for i, (schema, batch, fraction) in enumerate(cfg.points()):
            fields = {"schema": schema, "schema_text": None if schema == "none" else json.dumps(SCHEMAS[schema]),
                      "batch": batch, "fraction": fraction}
            row = record_point(store, ident, key(schema, batch, fraction), fields,
                               lambda: measure_point(llm, cfg, schema, batch, fraction, i), on_error, echo)
            echo(f"  {row['key']:<18} median TPOT {row['median_tpot'] * 1e3:8.2f} ms  "
                 f"{row['output_throughput']:9.1f} tok/s")
    return read_rows(run_dir)


def table(rows: list[dict]) -> list[str]:
    """Per (schema, batch): median TPOT of every fraction and its ratio to the unconstrained baseline (the median:
    one stall in a point moves its mean)."""
    ok = {r["key"]: r for r in rows if r.get("status") == "ok"}
    base = {r["batch"]: r for r in ok.values() if r["schema"] == "none"}
    lines = [f"{'schema':<7} {'batch':>5} {'fraction':>8} {'p50 TPOT':>9} {'vs f0':>7} {'mean TPOT':>9} "
             f"{'tok/s':>9} {'out/req':>8} {'parse':>7}  {TRAFFIC_HEADER}"]
    for r in sorted(ok.values(), key=lambda r: (r["batch"], r["schema"] != "none", r["schema"], r["fraction"])):
        b = base.get(r["batch"])
        ratio = r["median_tpot"] / b["median_tpot"] if b and b["median_tpot"] and \
            not math.isnan(r["median_tpot"]) else None
        parse = f"{r['constrained_stopped_parse']}/{r['constrained_stopped']}" if r["schema"] != "none" else "-"
        lines.append(f"{r['schema']:<7} {r['batch']:>5} {r['fraction']:>8g} {r['median_tpot'] * 1e3:>9.2f} "
                     f"{'-' if ratio is None else format(ratio, '.3f'):>7} {r['mean_tpot'] * 1e3:>9.2f} "
                     f"{r['output_throughput']:>9.1f} "
                     f"{r['total_output_tokens'] / r['completed']:>8.1f} {parse:>7}  {traffic_cell(r):<24}")
    return lines
