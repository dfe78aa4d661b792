"""The projected sweep (harness/projection/sweep.py, prefill.py, sources.py): its terms on hand-computed cases, rows
as complete and resumable as measured ones, and `deepinfer-bench sweep --decode-ranks 64` on the CPU machine from the
committed calibration rows (docs/projection.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.errors import DeepInferError
from deepinfer.harness.cli import cli
from deepinfer.harness.projection import hardware
from deepinfer.harness.projection.comm import AlphaBeta
from deepinfer.harness.projection.prefill import per_token_ms, project_prefill_step, schedule
from deepinfer.harness.projection.sources import PrefillCalibration, PrefillPoint, projectable, target_model
from deepinfer.harness.projection.step import ModelShape
from deepinfer.harness.projection.sweep import decode_step, run_projected_sweep
from deepinfer.harness.rows import read_rows
from deepinfer.harness.sweep import PUBLISHED_SWEEP, projection_reason
from deepinfer.harness.sweep_config import parse_sweep
from deepinfer.speculative.config import speculative_config

REPO = Path(__file__).resolve().parents[1]
MODEL = "random:deepseek_v41:flash:8"            # the calibration rows below are of this family at 4 layers


# ---- prefill ----
def test_schedule_by_hand():
    # 4 prompts of 100 tokens, 2 ranks, 150-token steps of 10 ms a token: rank 0 holds prompts 0 and 2 (200 tokens:
    # steps of 150 and 50 -> 1.5 s and 0.5 s); prompt 0 ends in step 1, prompt 2 in step 2
    plan = schedule([100, 100, 100, 100], 4, 2, 150, lambda t: t * 10.0)
    assert sorted(plan.ttfts) == pytest.approx([1.5, 1.5, 2.0, 2.0]) and plan.duration == pytest.approx(2.0)
    # two waves of one prompt each: TTFT from each prompt's own start, the duration adds up
    plan = schedule([100, 100], 1, 1, 1000, lambda t: t * 1.0)
    assert plan.ttfts == pytest.approx([0.1, 0.1]) and plan.duration == pytest.approx(0.2)
    # one prompt, 4 ranks: context parallel, a quarter each
    plan = schedule([1000], 1, 4, 300, lambda t: t * 1.0)
    assert plan.ttfts == pytest.approx([0.25]) and "context parallel: each prompt over 4 ranks" in plan.flags[0]


def _prefill_cal():
    return PrefillCalibration("random:deepseek_v41:flash:4", "NVIDIA H200", 4, "p", "2026-12-06",
                              (PrefillPoint(1000, 10.0), PrefillPoint(3000, 60.0)))


def test_prefill_step_by_hand():
    cal = _prefill_cal()
    flags = []
    assert per_token_ms(cal, 2000, flags) == pytest.approx((0.01 + 0.02) / 2) and flags == []
    assert per_token_ms(cal, 500, flags) == pytest.approx(0.01) and "prompts of 500 tokens outside" in flags[0]
    h200 = hardware.profile("H200")
    shape = ModelShape(hidden=128, vocab=1, layers=8, top_k=1)
    alone = project_prefill_step(cal, h200, h200, shape, {}, 1, 1000, 1000)     # EP 1: no exchange
    assert alone.step_ms == pytest.approx(1000 * 0.01 * 2) and alone.comm_ms == 0
    flat = AlphaBeta("t", "nvlink", "dispatch", 0.0, {8: 1e9}, "stated")
    ep = project_prefill_step(cal, h200, h200, shape, {"dispatch": flat, "combine": flat}, 8, 1000, 1000, "none")
    comm = (shape.dispatch_bytes(1000) + shape.combine_bytes(1000)) / 1e9 * 1e3 * 8      # ms over 8 layers
    assert ep.comm_ms == pytest.approx(comm) and ep.step_ms == pytest.approx(20 + comm)
    h100 = hardware.profile("H100")
    slower = project_prefill_step(cal, h200, h100, shape, {}, 1, 1000, 1000)
    assert slower.compute_ms == pytest.approx(20 * h200.bf16_flops_per_s / h100.bf16_flops_per_s)
    assert "prefill compute scaled from H200 to H100 by GEMM rate" in slower.flags


# ---- the sweep ----
def _step_row(run, **kw):
    row = {"bench": "step", "status": "ok", "model": "random:deepseek_v41:flash:4", "hardware": "NVIDIA H200",
           "precision": "bfloat16",
           "layers": 4, "run_id": run, "started": "2026-12-06T00:00:00+00:00", "graphed": True,
           "gpu_idle_fraction": 0.01, "kernel_backend": "triton", "query_len": 1, "context": 1024,
           "bytes": {"experts": 400.0, "state": 100.0, "total": 1000.0}, "expert_parallel": None, "ep_rank": 0}
    return {**row, **kw}


def _calibration_runs(root: Path) -> None:
    """A rank-view run (EP 1 and 8) and a prefill run of the V4.1 flash family, written as the step bench does."""
    rank_view = [_step_row("rv", ep_size=ep, batch=b, key=f"ep{ep}/b{b}", step_ms_median=1.0 + b / 64)
                 for ep in (1, 8) for b in (1, 16, 64)]
    prefill = [_step_row("pf", key=f"prefill-t{t}", shape="prefill", query_len=t, batch=1, context=0,
                         graphed=False, step_ms_median=t / 100) for t in (2048, 8192)]
    for name, rows in (("step-rv", rank_view), ("step-pf", prefill)):
        (root / "1" / name).mkdir(parents=True)
        (root / "1" / name / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


SMALL = {"name": "proj", "model": MODEL, "device": "cuda", "dtype": "bfloat16", "mode": "both",
         "scenarios": [{"isl": 1024, "osl": 256}], "topology": {"prefill_ranks": 2, "decode_ranks": 8, "ep": 8},
         "engine_args": {"max_num_batched_tokens": 4096, "expert_dispatch": "deepep"},
         "concurrency": {"prefill": [1, 4], "decode": [8, 64, 512]},
         "speculative": ["off", {"schedule": "fixed"}, {"schedule": "confidence"}]}


def test_projected_rows_complete_and_resumable(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                                  # no ./reports: the calibration is this test's
    _calibration_runs(tmp_path)
    cfg = parse_sweep(SMALL)
    run = run_projected_sweep(cfg, tmp_path, "p", echo=lambda line: None)
    rows = read_rows(run)
    assert len(rows) == len(cfg.points()) == 15 and all(r["status"] == "ok" for r in rows)
    assert json.loads((run / "projection.json").read_text())["sweep"] == cfg.to_dict()
    for r in rows:
        assert r["is_projected"] is True and r["hardware"] == "H200" and r["flags"]
        p = r["projection"]
        assert p["calibration"]["decode"]["run"] == "step-rv" and p["calibration"]["prefill"]["run"] == "step-pf"
        assert p["layers"] == 8 and p["dispatch"] == "deepep" and p["version"]
        key = "output_tput_per_gpu" if r["mode"] == "decode" else "input_tput_per_gpu"
        assert r[key] > 0 and r["gpus"] == (8 if r["mode"] == "decode" else 2)
    decode = {r["key"]: r for r in rows if r["mode"] == "decode"}
    off, fixed = decode["none/decode/isl1024-osl256/c64"], decode["dspark-fixed-5/decode/isl1024-osl256/c64"]
    assert off["spec_mode"] == "none" and fixed["spec_mode"] == "dspark-fixed-5"
    assert fixed["projected_step"]["verified_drafts"] == 5
    assert fixed["projected_step"]["accepted_per_step"] == pytest.approx(1 + 0.788 + 0.632 + 0.485 + 0.321 + 0.284)
    # 8 sequences a rank: TPOT = step / accepted tokens, per-GPU throughput = c x accepted / step / ranks
    step = off["projected_step"]["step_ms"] / 1e3
    assert off["projected_step"]["batch_per_rank"] == 8 and off["median_tpot"] == pytest.approx(step)
    assert off["output_tput_per_gpu"] == pytest.approx(64 / step / 8) and off["median_intvty"] == pytest.approx(1 / step)
    # ITL is the step (a speculative step's tokens arrive together); TPOT the step over its tokens
    assert fixed["median_itl"] == pytest.approx(fixed["projected_step"]["step_ms"] / 1e3)
    assert fixed["median_tpot"] == pytest.approx(fixed["median_itl"] / fixed["projected_step"]["accepted_per_step"])
    # the confidence schedule verifies every draft at light load and fewer once the verify rows cost more than they
    # bring (the calibration's step grows with rows: 1 + b / 64 ms)
    light, heavy = (decode[f"dspark-confidence-5/decode/isl1024-osl256/c{c}"]["projected_step"] for c in (8, 512))
    assert light["verified_drafts"] == 5 and heavy["verified_drafts"] < 5
    # a prefill point's TTFTs are its schedule's: 4 prompts on 2 ranks, one wave, each rank one prompt a step
    pre = next(r for r in rows if r["key"] == "none/prefill/isl1024-osl256/c4")
    assert pre["p99_ttft"] >= pre["median_ttft"] > 0 and pre["p99_e2el"] == pytest.approx(pre["p99_ttft"])
    # resumable: a run cut after 5 rows finishes the other 10 and keeps the first 5 as they were
    lines = (run / "rows.jsonl").read_text().splitlines(keepends=True)
    (run / "rows.jsonl").write_text("".join(lines[:5]))
    run_projected_sweep(cfg, tmp_path, "p", resume=True, echo=lambda line: None)
    again = read_rows(run)
    assert len(again) == 15 and again[:5] == rows[:5] and {r["key"] for r in again} == {r["key"] for r in rows}
    # resuming with another projection (hardware) is refused in one line; a new run id is not
    with pytest.raises(DeepInferError, match="differs from this projection"):
        run_projected_sweep(cfg, tmp_path, "p", resume=True, hardware="B200", echo=lambda line: None)
    faster = read_rows(run_projected_sweep(cfg, tmp_path, "b200", hardware="B200", echo=lambda line: None))
    assert faster[-1]["hardware"] == "B200" and any("compute scaled from H200 to B200" in f for f in faster[-1]["flags"])


def test_released_checkpoint_rows_calibrate_their_family(tmp_path, monkeypatch):
    from deepinfer.harness.projection.sources import decode_calibration
    monkeypatch.chdir(tmp_path)
    _calibration_runs(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "1" / "step-rv" / "rows.jsonl").read_text().splitlines()]
    (tmp_path / "1" / "step-real").mkdir()
    (tmp_path / "1" / "step-real" / "rows.jsonl").write_text("".join(
        json.dumps({**r, "model": "deepseek-ai/DeepSeek-V4.1-Flash-1017", "layers": 40}) + "\n" for r in rows))
    cal = decode_calibration(tmp_path, target_model(MODEL), "step-real")
    assert cal.run == "step-real" and cal.layers == 40


def test_projection_refuses_what_it_cannot_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DeepInferError, match="no decode calibration of deepseek_v41/flash"):
        run_projected_sweep(parse_sweep(SMALL), tmp_path / "empty", "x", echo=lambda line: None)
    assert not (tmp_path / "empty").exists()
    with pytest.raises(DeepInferError, match="a projection needs the model's shape"):
        target_model("tiny")
    _calibration_runs(tmp_path)
    bad = {**SMALL, "engine_args": {"expert_dispatch": "allgather"}}
    with pytest.raises(DeepInferError, match="expert_dispatch='allgather' has no published series"):
        run_projected_sweep(parse_sweep(bad), tmp_path, "y", echo=lambda line: None)
    # checked before anything is written: an EP size the calibration lacks, numerics it did not run
    wide = {**SMALL, "topology": {"prefill_ranks": 2, "decode_ranks": 16, "ep": 16}}
    with pytest.raises(DeepInferError, match=r"the decode role runs EP 16.*rank views at EP \[1, 8\]"):
        run_projected_sweep(parse_sweep(wide), tmp_path, "z", echo=lambda line: None)
    fp32 = {**SMALL, "dtype": "float32"}
    with pytest.raises(DeepInferError, match="precision float32 \\(the calibration: bfloat16\\)"):
        run_projected_sweep(parse_sweep(fp32), tmp_path, "w", echo=lambda line: None)
    assert not any((tmp_path / "1" / r).exists() for r in "xyzw")


def test_published_shape_is_the_sweep_file():
    from deepinfer.harness.sweep_config import load_sweep
    assert parse_sweep(PUBLISHED_SWEEP).to_dict() == load_sweep(REPO / "sweeps" / "v41-flash-published.yaml").to_dict()


def test_when_a_sweep_is_projected(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    published = parse_sweep(PUBLISHED_SWEEP)
    assert projection_reason(published) and "--measure refuses instead" in projection_reason(published)
    assert projection_reason(published, measure=True) is None
    cpu = parse_sweep({**SMALL, "device": "cpu"})
    assert projection_reason(cpu) is None and projection_reason(cpu, project=True).startswith("--project")
    assert projection_reason(parse_sweep({**SMALL, "model": "tiny", "speculative": ["off"]})) is None
    monkeypatch.setenv("WORLD_SIZE", "64")                       # a torchrun launch measures
    assert projection_reason(published) is None
    assert projectable("deepseek-ai/DeepSeek-V4.1-Flash-1017") and not projectable("random:deepseek_v4:tiny:2")


def test_decode_ranks_64_on_cpu_from_committed_calibration(tmp_path, monkeypatch):
    """The issue's done-when: the bare command on this machine writes projected rows and both published charts."""
    monkeypatch.chdir(REPO)                                      # the committed calibration rows: ./reports
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    res = CliRunner().invoke(cli, ["sweep", "--decode-ranks", "64", "--report-dir", str(tmp_path), "--run-id", "p",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("notice: this launch has") and "projected" in res.output
    rows = read_rows(tmp_path / "1" / "p")
    assert len(rows) == len(parse_sweep(PUBLISHED_SWEEP).points()) and all(r["status"] == "ok" for r in rows)
    assert {r["gpus"] for r in rows if r["mode"] == "decode"} == {64} and all(r["is_projected"] for r in rows)
    assert (tmp_path / "published" / "prefill.html").exists() and (tmp_path / "published" / "decode.html").exists()
    res = CliRunner().invoke(cli, ["sweep", "--decode-ranks", "64", "--measure", "--report-dir", str(tmp_path)])
    assert res.exit_code != 0 and "asks for 64 decode ranks" in str(res.exception)


# ---- plan ----
def test_plan_picks_the_best_fitting_deployment(tmp_path, monkeypatch):
    from deepinfer.harness.projection.plan import parse_tpot, plan, table
    monkeypatch.chdir(tmp_path)
    _calibration_runs(tmp_path)
    for r in (tmp_path / "1" / "step-rv").glob("rows.jsonl"):           # EP 1 rows name the model's bytes
        rows = [json.loads(line) for line in r.read_text().splitlines()]
        for row in rows:
            row["expert_bytes_all"] = 8e9
            row["bytes"]["dense_weights"] = 2e9
        r.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert parse_tpot("30ms") == 30 and parse_tpot("0.05s") == 50 and parse_tpot("20") == 20
    with pytest.raises(DeepInferError, match="--slo-tpot 'fast'"):
        parse_tpot("fast")
    proj, cands = plan(8, MODEL, 50.0, tmp_path)
    fit = [c for c in cands if c.tok_s_per_gpu is not None]
    assert fit and fit == sorted(fit, key=lambda c: -c.tok_s_per_gpu)
    assert {c.ep for c in cands} == {1, 2, 4, 8}
    assert all("not calibrated" in c.why for c in cands if c.ep in (2, 4))
    for c in fit:                            # the SLO holds at the chosen batch, and one more sequence breaks it
        assert c.tpot_ms <= 50.0 and c.replicas * c.ep == 8
        if c.batch_per_rank < 1024 and not c.why:
            spec = None if c.spec_mode == "none" else speculative_config({"schedule": c.spec_mode.split("-")[1]}, 5,
                                                                           "dspark")
            assert decode_step(proj, c.ep, c.batch_per_rank + 1, 1024 + 512, spec).tpot_s * 1e3 > 50.0
    lines = table(cands, 3)
    assert lines[1].split()[0] == "1" and any("EP 4 not calibrated" in line for line in lines)
    res = CliRunner().invoke(cli, ["plan", "--gpus", "8", "--model", MODEL, "--slo-tpot", "50ms", "--report-dir",
                                   str(tmp_path), "--run-id", "pl"])
    assert res.exit_code == 0, res.output
    assert len(read_rows(tmp_path / "1" / "pl")) == len(cands)
