"""`deepinfer-bench dspark` on tiny V4.1, CPU: one row per (mode, concurrency) with the speculation counters,
pinned acceptance near its curve, the table's ratios against off and fixed, bad options one line, a run directory
with rows refused; and a sweep's `speculative` axis writing rows that say their spec_mode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.harness.dspark_bench import CURVES, DSparkConfig, fixed_verified_at, run_dspark_bench, table
from deepinfer.harness.rows import read_rows
from tests.helpers import assert_traffic


def test_rows_carry_speculation_counters(tmp_path):
    cfg = DSparkConfig(modes=("off", "fixed", "budget"), concurrency=(1, 2), isl=16, osl=32, rounds=2)
    rows = run_dspark_bench(cfg, tmp_path / "run", png=False)
    assert (tmp_path / "run" / "decode_pareto.html").exists() and (tmp_path / "run" / "summary.csv").exists()
    # the modes of a point run back to back (one engine per mode, built before the first point)
    assert [r["key"] for r in rows] == ["off/c1", "fixed/c1", "budget/c1", "off/c2", "fixed/c2", "budget/c2"]
    by = {r["key"]: r for r in rows}
    for r in rows:
        assert r["status"] == "ok" and r["completed"] == 2 * r["concurrency"]
        assert r["total_output_tokens"] == 32 * r["completed"]
        assert_traffic(r)               # each mode's own steps, though every engine shares one model's counters
    off, fixed = by["off/c1"], by["fixed/c1"]
    assert off["spec_mode"] == "none" and off["mean_accepted_length"] == 1.0 and off["draft_tokens"] == 0
    assert fixed["spec_mode"] == "dspark-fixed-5" and fixed["pinned_survival"] == list(CURVES["v41-flash"])
    # pinned golden curve: mean accepted length about 1 + sum(survival) = 3.51 (rows cut short at the end lower it)
    assert 2.8 < fixed["mean_accepted_length"] < 4.0, fixed["mean_accepted_length"]
    assert len(fixed["acceptance_by_position"]) == 5 and fixed["acceptance_by_position"][0] > 0.5
    assert fixed["verify_rows"] == fixed["drafts_by_position"][0] > 0
    assert fixed["step_rate"] is None                                        # profiled for a varlen schedule:
    assert sorted(map(int, by["budget/c1"]["step_rate"])) == [0, 16 + 32 + 5 + 8 - 6]   # per context: 0, the longest
    assert all(r["engine_stats"]["timed_attempts"] == 1 for r in rows)       # no graphs on CPU: one timed pass
    # measured step times by shape (segments, rows) beside the table's; no graph padding on CPU: nothing filled
    times = by["budget/c2"]["step_times"]
    assert times and all(t["steps"] >= 3 and t["measured_ms"] > 0 and t["table_ms"] > 0 for t in times)
    assert {t["segments"] for t in times} <= {1, 2} and by["budget/c2"]["drafts_filled"] == 0
    assert all(t["table_ms"] is None for t in fixed["step_times"]) and off["step_times"] is None
    lines = table(rows)
    assert len(lines) == 7
    assert lines[2].split()[1] == "fixed" and lines[2].split()[6] == \
        f"{fixed['median_intvty'] / off['median_intvty']:.3f}"
    assert json.loads((tmp_path / "run" / "dspark.json").read_text())["osl"] == 32
    with pytest.raises(DeepInferError, match="already has rows"):
        run_dspark_bench(cfg, tmp_path / "run", png=False)
    assert len(read_rows(tmp_path / "run")) == 6


def test_verified_tokens_fixed_needs_for_an_accepted_length():
    """Survival 0.8, 0.6, 0.4: AL 1.8 / 2.4 / 2.8 with 1 / 2 / 3 drafts verified (2 / 3 / 4 tokens a row);
    between them a share of the rows verifies one draft more."""
    s = [0.8, 0.6, 0.4]
    assert fixed_verified_at(1.0, s) == 1.0 and fixed_verified_at(1.8, s) == pytest.approx(2.0)
    assert fixed_verified_at(2.1, s) == pytest.approx(2.5)          # 1.8 + 0.5 x 0.6: half the rows verify draft 2
    assert fixed_verified_at(2.8, s) == pytest.approx(4.0)
    assert fixed_verified_at(2.81, s) is None and fixed_verified_at(None, s) is None
    rows = [{"status": "ok", "schedule": m, "concurrency": 4, "output_throughput": 100.0, "median_intvty": 25.0,
             "mean_accepted_length": al, "verified_tokens_per_row": v, "acceptance_by_position": s}
            for m, al, v in (("fixed", 2.8, 4.0), ("confidence", 2.1, 2.25))]
    assert table(rows)[2].split()[-2] == f"{2.25 / 2.5:.3f}"          # 10% fewer than fixed needs for AL 2.1 (last: traffic)


def test_a_point_out_of_device_memory_is_a_failed_row_and_the_run_goes_on(tmp_path, monkeypatch):
    """CUDA's out-of-memory error in one point (every mode's engine is held at once) becomes that point's failed
    row with one line saying what to do; the points after it still run."""
    import torch

    from deepinfer.harness import dspark_bench
    real = dspark_bench.measure_point

    def measure(llm, cfg, concurrency, index):
        if concurrency == 2 and llm.engine.speculation is not None:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 640.00 MiB.\nmore detail")
        return real(llm, cfg, concurrency, index)
    monkeypatch.setattr(dspark_bench, "measure_point", measure)
    cfg = DSparkConfig(modes=("off", "fixed"), concurrency=(1, 2, 3), isl=8, osl=8, rounds=1)
    rows = {r["key"]: r for r in run_dspark_bench(cfg, tmp_path / "run", png=False)}
    assert len(rows) == 6 and rows["fixed/c2"]["status"] == "failed"
    assert rows["fixed/c2"]["error"].startswith("out of device memory at concurrency 2 (CUDA out of memory.")
    assert "\n" not in rows["fixed/c2"]["error"] and "fewer --modes" in rows["fixed/c2"]["error"]
    assert all(r["status"] == "ok" for k, r in rows.items() if k != "fixed/c2")


def test_one_engine_holds_one_modes_engine_at_a_time(tmp_path, monkeypatch):
    """--one-engine builds a mode's engine, runs its points and lets it go before the next mode's is built (a deep
    model's largest points then fit beside one engine); the rows are the same points, mode by mode, and say so."""
    import gc
    import weakref

    from deepinfer.harness import dspark_bench
    real, live = dspark_bench._engine, []

    def engine(model, cfg, mode):
        gc.collect()
        held = [m for m, ref in live if ref() is not None]
        assert held == [], f"{mode}'s engine built while {held} still held"
        llm = real(model, cfg, mode)
        live.append((mode, weakref.ref(llm)))
        return llm
    monkeypatch.setattr(dspark_bench, "_engine", engine)
    cfg = DSparkConfig(modes=("off", "fixed"), concurrency=(1, 2), isl=8, osl=8, rounds=1, one_engine=True)
    rows = run_dspark_bench(cfg, tmp_path / "run", png=False)
    assert [r["key"] for r in rows] == ["off/c1", "off/c2", "fixed/c1", "fixed/c2"]
    assert all(r["status"] == "ok" and r["engines_held"] == 1 for r in rows)
    assert [m for m, _ in live] == ["off", "fixed"]


def test_v4_mtp_on_the_prompt_set_with_repeats(tmp_path):
    """A V4 model drafts with its MTP layer (spec_mode mtp-...); --prompts takes the project-owned set through the
    chat template, cut to --isl, ending at EOS or --osl; --repeats builds the engines again and keys rows per
    repeat, and the table gives medians with the ranges."""
    from deepinfer.harness.dspark_bench import PROMPT_FILE
    cfg = DSparkConfig(model="random:deepseek_v4:tiny:2", modes=("off", "fixed"), concurrency=(2,), isl=24, osl=6,
                       rounds=1, prompts="math", repeats=2, acceptance="measured", num_speculative_tokens=2)
    rows = run_dspark_bench(cfg, tmp_path / "run", png=False)
    assert [r["key"] for r in rows] == ["off/c2/r0", "fixed/c2/r0", "off/c2/r1", "fixed/c2/r1"]
    assert [r["repeat"] for r in rows] == [0, 0, 1, 1] and all(r["prompts"] == "math" for r in rows)
    assert rows[1]["spec_mode"] == "mtp-fixed-2" and rows[1]["pinned_survival"] is None
    for r in rows:
        assert r["status"] == "ok" and r["completed"] == 2 and 0 < r["total_output_tokens"] <= 12
        assert r["total_input_tokens"] <= 2 * 24
    assert rows[0]["total_output_tokens"] == rows[2]["total_output_tokens"]        # the same workload each repeat
    lines = table(rows)
    assert len(lines) == 3 and "range" in lines[0] and "-" in lines[2].split()[-1]
    assert sum(1 for line in PROMPT_FILE.read_text().splitlines() if '"math"' in line) >= 8


@pytest.mark.parametrize("kw,why", [
    ({"modes": ("fast",)}, "--modes 'fast': choose from off, fixed, confidence, budget"),
    ({"acceptance": "high"}, "--acceptance 'high': give one of"),
    ({"acceptance": "0.5,0.7"}, "must be non-increasing"),
    ({"model": "random:deepseek_v4:tiny:2", "num_speculative_tokens": 6}, "must be an integer in 1..5"),
    ({"osl": 1}, "--osl must be at least 2"),
    ({"prompts": "poems"}, "--prompts 'poems': choose from random, all, code, math, chat"),
    ({"repeats": 0}, "--repeats must be at least 1"),
    ({"num_speculative_tokens": 9}, "must be an integer in 1..5"),
])
def test_bad_settings_are_one_line(kw, why):
    with pytest.raises(DeepInferError, match=why) as info:
        DSparkConfig(**kw).check()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("args,why", [
    (["--modes", "fast"], "--modes 'fast': choose from off, fixed, confidence, budget"),
    (["--acceptance", "0.5,0.7"], "must be non-increasing"),
])
def test_bad_options_are_one_line(tmp_path, args, why):
    cmd = [sys.executable, "-c", "import sys; from deepinfer.harness.cli import main; sys.argv[0] = "
           "'deepinfer-bench'; main()", "dspark", "--out", str(tmp_path / "r"), "--concurrency", "1", *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    err = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith("INFO")]
    assert len(err) == 1 and why in err[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_sweep_speculative_axis_rows_say_their_mode(tmp_path):
    from deepinfer.harness.sweep import run_sweep
    from deepinfer.harness.sweep_config import parse_sweep
    cfg = parse_sweep({"name": "spec", "model": "random:deepseek_v41:tiny:2", "device": "cpu", "mode": "decode",
                       "engine_args": {"max_num_seqs": 2, "max_model_len": 128},
                       "scenarios": [{"isl": 16, "osl": 12}], "concurrency": [1],
                       "speculative": ["off", {"schedule": "fixed", "acceptance": [0.8, 0.6, 0.4, 0.3, 0.2]}]})
    run_dir = run_sweep(cfg, tmp_path, run_id="s", progress=False)
    rows = read_rows(run_dir)
    assert [(r["key"], r["spec_mode"], r["status"]) for r in rows] == [
        ("none/decode/isl16-osl12/c1", "none", "ok"), ("dspark-fixed-5/decode/isl16-osl12/c1", "dspark-fixed-5", "ok")]
    plain, spec = (r["engine_stats"] for r in rows)
    assert plain["committed_tokens"] == spec["committed_tokens"]     # the same workload under both settings
    assert spec["steps"] < plain["steps"]                  # drafts accepted: fewer steps for the same tokens
