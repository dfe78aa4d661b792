"""deepinfer-bench sweep on the tiny CPU model: rows per point, resume after an interrupted run without lost or
repeated rows, failure rows, topology errors, the CLI."""

import json
import re

import pytest
from click.testing import CliRunner

from deepinfer.errors import DeepInferError
from deepinfer.harness import sweep as sweep_mod
from deepinfer.harness.cli import cli
from deepinfer.harness.rows import RowStore, read_rows
from deepinfer.harness.sweep import DEFAULT_SWEEP, TopologyError, run_sweep
from deepinfer.harness.sweep_config import SweepConfigError, load_sweep, parse_sweep
from tests.helpers import assert_traffic

MICRO = {"name": "micro", "model": "tiny", "device": "cpu",
         "engine_args": {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 64},
         "scenarios": [{"isl": 16, "osl": 4}], "concurrency": [1, 2], "num_prompts_per_concurrency": 5}


def test_default_sweep_is_the_tiny_cpu_file():
    assert parse_sweep(DEFAULT_SWEEP).to_dict() == load_sweep("sweeps/tiny-cpu.yaml").to_dict()


def test_sweep_rows_resume_and_failures(tmp_path, monkeypatch):
    cfg = parse_sweep(MICRO)
    keys = [p.key for p in cfg.points()]
    real, calls = sweep_mod.run_point, []

    def dies_on_third(llm, cfg, point, index, ranks):
        calls.append(point.key)
        if len(calls) == 3:
            raise KeyboardInterrupt                  # the run is killed mid-point
        return real(llm, cfg, point, index, ranks)
    monkeypatch.setattr(sweep_mod, "run_point", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, tmp_path, "r1", progress=False)
    done = RowStore(tmp_path / "1" / "r1").done_keys()
    assert done == set(keys[:2])
    with pytest.raises(DeepInferError, match="already has rows: pass --resume"):
        run_sweep(cfg, tmp_path, "r1", progress=False)
    calls.clear()
    monkeypatch.setattr(sweep_mod, "run_point", real)
    run_dir = run_sweep(cfg, tmp_path, "r1", resume=True, progress=False)
    rows = RowStore(run_dir).rows()
    assert [r["key"] for r in rows] == keys and all(r["status"] == "ok" for r in rows)   # nothing lost or repeated
    for r in rows:
        assert r["schema_version"] == "1" and r["method_version"] and r["model_type"] == "deepseek_v41"
        assert r["completed"] == r["num_prompts"] and r["gpus"] == 1 and r["is_projected"] is False
        assert r["hardware_info"]["cpu_count"] >= 1 and r["git_sha"] is not None and r["config_hash"]
        parts = [r[k] for k in ("host_plan_ms", "host_launch_ms", "host_apply_ms")]
        assert all(v > 0 for v in parts) and r["device_wait_ms"] >= 0               # the loop's time per step
        assert r["device_wait_ms"] < r["host_launch_ms"]          # a CPU step's tokens are ready once it returns
        assert r["host_ms"] == pytest.approx(sum(parts), abs=1e-3)
        if r["mode"] == "decode":
            assert r["output_tput_per_gpu"] > 0 and r["median_intvty"] > 0
        else:
            assert r["input_tput_per_gpu"] > 0 and r["p99_ttft"] > 0 and r["median_tpot"] is None
    raw = json.loads((run_dir / "raw" / "decode__isl16-osl4__c2.json").read_text())
    assert raw["max_concurrency"] == 2 and len(raw["ttfts"]) == 10 and "median_tpot_ms" in raw
    assert (run_dir / "env.json").exists() and (run_dir / "sweep.yaml").exists()
    changed = parse_sweep({**MICRO, "seed": 5})
    with pytest.raises(DeepInferError, match="sweep.yaml differs"):
        run_sweep(changed, tmp_path, "r1", resume=True, progress=False)

    def broken(llm, cfg, point, index, ranks):
        raise RuntimeError("no memory")
    monkeypatch.setattr(sweep_mod, "run_point", broken)
    with pytest.raises(DeepInferError, match="point prefill/isl16-osl4/c1 failed .*--resume"):
        run_sweep(cfg, tmp_path, "r2", progress=False)
    run_sweep(cfg, tmp_path, "r3", continue_on_error=True, progress=False)
    failed = RowStore(tmp_path / "1" / "r3").rows()
    assert len(failed) == len(keys) and all(r["status"] == "failed" and "no memory" in r["error"] for r in failed)


def test_rows_record_the_engine_switches_and_resume_keeps_them(tmp_path, no_engine_switches):
    """A row taken under a DEEPINFER_* switch says so (engine_env); resuming under other switches is refused, so
    one run never mixes rows of two engines."""
    cfg = parse_sweep({**MICRO, "concurrency": [1], "scenarios": [{"isl": 16, "osl": 4}, {"isl": 24, "osl": 4}]})
    monkeypatch = no_engine_switches
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    real = sweep_mod.run_point

    def one_then_dies(llm, cfg, point, index, ranks):
        if index == 1:
            raise KeyboardInterrupt
        return real(llm, cfg, point, index, ranks)
    monkeypatch.setattr(sweep_mod, "run_point", one_then_dies)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, tmp_path, "e1", progress=False)
    rows = RowStore(tmp_path / "1" / "e1").rows()
    assert [r["engine_env"] for r in rows] == [{"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact"}]
    monkeypatch.setattr(sweep_mod, "run_point", real)
    monkeypatch.delenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE")
    with pytest.raises(DeepInferError, match="was run with DEEPINFER_\\* switches .*compact.*this process has none"):
        run_sweep(cfg, tmp_path, "e1", resume=True, progress=False)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    rows = RowStore(run_sweep(cfg, tmp_path, "e1", resume=True, progress=False)).rows()
    compact = {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "compact"}
    assert len(rows) == len(cfg.points()) and all(r["engine_env"] == compact for r in rows)


def test_a_warm_pass_runs_every_point_first_and_leaves_no_cache_behind(tmp_path, monkeypatch):
    """warm_pass: each point runs once unrecorded (one request per concurrency slot) before the timed points; the
    engine forgets what that pass cached, so the timed rows' prefix hits are what they are without it."""
    spec = {**MICRO, "mode": "prefill", "concurrency": [2], "warmup": 1,
            "engine_args": {**MICRO["engine_args"], "enable_prefix_caching": True, "block_size": 16,
                            "max_model_len": 256},
            "scenarios": [{"isl": 200, "osl": 1, "shared": 0.75}]}          # a head of 150: past the replay (71)
    real, calls = sweep_mod.run_point, []

    def counted(llm, cfg, point, index, ranks):
        calls.append(point.num_prompts)
        return real(llm, cfg, point, index, ranks)
    monkeypatch.setattr(sweep_mod, "run_point", counted)
    rows = {}
    for warm in (False, True):
        calls.clear()
        cfg = parse_sweep({**spec, "warm_pass": warm})
        rows[warm] = RowStore(run_sweep(cfg, tmp_path, f"w{int(warm)}", progress=False)).rows()[0]
        assert calls == ([2, 10] if warm else [10])
    for k in ("prefix_hit_tokens", "prefill_tokens_computed", "prefix_replayed_tokens"):
        assert rows[True][k] == rows[False][k], k
    assert rows[True]["prefix_hit_tokens"] > 0 and rows[True]["warm_pass"] and not rows[False]["warm_pass"]
    with pytest.raises(SweepConfigError, match="warm_pass: must be true or false"):
        parse_sweep({**spec, "warm_pass": "yes"})


def test_concurrency_beyond_the_engine_is_refused_by_the_file(tmp_path):
    """max_num_seqs decides it before any run: the file is refused (the run-time check, for seats lost to the
    memory budget, writes a failure row)."""
    with pytest.raises(SweepConfigError, match="concurrency 8 needs 8 sequences per replica .* allow 4"):
        parse_sweep({**MICRO, "concurrency": [8]})                # the engine has 4 seats
    assert not (tmp_path / "1").exists()


def test_topology_errors(tmp_path, monkeypatch):
    with pytest.raises(TopologyError, match="asks for 64 decode ranks but this launch has 1 .*torchrun"):
        run_sweep(parse_sweep({**MICRO, "topology": {"decode_ranks": 64}}), tmp_path, progress=False)
    monkeypatch.setenv("WORLD_SIZE", "2")            # one expert-parallel engine spans the launch: both roles
    with pytest.raises(TopologyError, match="the decode role runs one expert-parallel engine .* two sweeps"):
        run_sweep(parse_sweep({**MICRO, "topology": {"decode_ranks": 2, "ep": 2}}), tmp_path, progress=False)


def test_replica_split():
    from deepinfer.harness.ranks import split
    assert split(4, 20, 2) == [(2, 0, 10), (2, 10, 20)]
    assert split(1, 5, 2) == [(1, 0, 5)]                       # fewer requests in flight than replicas
    assert split(5, 25, 2) == [(3, 0, 15), (2, 15, 25)]
    assert split(3, 15, 1) == [(3, 0, 15)]
    for c, n, r in [(7, 35, 3), (64, 320, 64), (2, 11, 4)]:
        parts = split(c, n, r)
        assert sum(p[0] for p in parts) == c and parts[0][1] == 0 and parts[-1][2] == n
        assert all(a[2] == b[1] for a, b in zip(parts, parts[1:]))


def test_two_rank_sweep_under_torchrun(tmp_path):
    """torchrun, two CPU ranks on gloo: prefill points on one rank, decode points split over two replicas; rank 0
    writes one row per point with every request, throughput per GPU over the role's two ranks."""
    import socket
    import subprocess
    import sys
    from pathlib import Path
    exe = Path(sys.executable).parent / "deepinfer-bench"
    if not exe.exists():
        pytest.skip("deepinfer-bench is not installed")
    sweep = {**MICRO, "topology": {"prefill_ranks": 1, "decode_ranks": 2}, "concurrency": [1, 2, 4]}
    (tmp_path / "two.yaml").write_text(json.dumps(sweep))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), str(exe), "sweep", str(tmp_path / "two.yaml"), "--report-dir", str(tmp_path / "r"),
                        "--run-id", "two", "--no-progress"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["key"]: r for r in RowStore(tmp_path / "r" / "1" / "two").rows()}
    assert len(rows) == 6 and all(r["status"] == "ok" and r["launch_ranks"] == 2 for r in rows.values())
    for c in (1, 2, 4):
        pre, dec = rows[f"prefill/isl16-osl4/c{c}"], rows[f"decode/isl16-osl4/c{c}"]
        assert pre["gpus"] == 1 and dec["gpus"] == 2
        assert pre["completed"] == dec["completed"] == 5 * c
        assert dec["output_tput_per_gpu"] == pytest.approx(dec["output_throughput"] / 2)
        assert dec["median_tpot"] > 0 and dec["duration"] > 0
    raw = json.loads((tmp_path / "r" / "1" / "two" / "raw" / "decode__isl16-osl4__c4.json").read_text())
    assert len(raw["ttfts"]) == 20 and all(t > 0 for t in raw["ttfts"])
    assert (tmp_path / "r" / "1" / "two" / "decode_pareto.html").exists()          # rank 0 wrote the report


def test_cli(tmp_path):
    (tmp_path / "micro.yaml").write_text(json.dumps(MICRO))
    runner = CliRunner()
    res = runner.invoke(cli, ["sweep", str(tmp_path / "micro.yaml"), "--report-dir", str(tmp_path / "rep"),
                              "--run-id", "c", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "4 points in" in res.output and "tok/s/user" in res.output
    assert re.search(r"decode/isl16-osl4/c2 .* tok/s/user  step: host [0-9.]+ ms, waits [0-9.]+ ms", res.output)
    res = runner.invoke(cli, ["sweep", str(tmp_path / "micro.yaml"), "--decode-ranks", "8", "--report-dir",
                              str(tmp_path / "rep")])
    assert res.exit_code != 0 and "asks for 8 decode ranks" in str(res.exception)
    res = runner.invoke(cli, ["sweep", str(tmp_path / "nope.yaml")])
    assert res.exit_code != 0


def test_report_is_regenerated_byte_for_byte_from_rows(tmp_path):
    from deepinfer.harness.report import report_run, write_index
    run_dir = run_sweep(parse_sweep(MICRO), tmp_path, "rep", progress=False)
    first = report_run(run_dir, png=False)
    for r in read_rows(run_dir):
        assert_traffic(r)
    names = sorted(p.name for p in first)
    assert names == ["decode_pareto.html", "prefill_pareto.html", "summary.csv"]
    before = {p.name: p.read_bytes() for p in first}
    index = write_index(tmp_path).read_text()
    for p in first:
        p.unlink()
    again = report_run(run_dir, png=False)
    assert {p.name: p.read_bytes() for p in again} == before          # a pure function of the stored rows
    assert write_index(tmp_path).read_text() == index and "| rep | 1 | 4 / 0 |" in index
    assert (tmp_path / "plotly.min.js").exists()
    html = before["decode_pareto.html"].decode()
    assert "frontier" in html and "per user" in html
    import pandas as pd
    table = pd.read_csv(run_dir / "summary.csv")
    assert list(table["key"]) == [p.key for p in parse_sweep(MICRO).points()]


def test_report_keeps_a_png_only_while_its_chart_is_unchanged(tmp_path):
    """Without a browser (or with --no-png) the report keeps a PNG another machine rendered while the same rows give
    the same chart, and removes it once the chart changed: never a picture of other rows."""
    from deepinfer.harness.report import report_run
    run_dir = run_sweep(parse_sweep(MICRO), tmp_path, "rep", progress=False)
    report_run(run_dir, png=False)
    png = run_dir / "decode_pareto.png"
    png.write_bytes(b"rendered elsewhere")
    assert png in report_run(run_dir, png=False) and png.read_bytes() == b"rendered elsewhere"
    rows = read_rows(run_dir)
    fewer = [r for r in rows if r["mode"] != "decode"] + [r for r in rows if r["mode"] == "decode"][1:]
    assert png not in report_run(run_dir, png=False, rows=fewer) and not png.exists()
    assert (run_dir / "decode_pareto.html").exists() and read_rows(run_dir) == rows


def test_report_charts_a_run_against_an_earlier_one(tmp_path):
    """--against: one chart per mode with a series per run (both runs' frontiers), beside the run's own charts."""
    old = run_sweep(parse_sweep(MICRO), tmp_path, "old", progress=False)
    new = run_sweep(parse_sweep({**MICRO, "seed": 3}), tmp_path, "new", progress=False)
    res = CliRunner().invoke(cli, ["report", "new", "--against", "old", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    html = (new / "decode_vs_old.html").read_text()
    assert '"name":"new \\u002f' in html and '"name":"old \\u002f' in html and html.count(" frontier") == 2
    assert (new / "prefill_vs_old.html").exists() and not list(old.glob("*_vs_*"))
    for args, msg in ((["new", "old", "--against", "old"], "exactly one RUN_ID"),
                      (["new", "--against", "gone"], "no stored rows for run(s) ['gone']")):
        res = CliRunner().invoke(cli, ["report", *args, "--report-dir", str(tmp_path), "--no-png"])
        assert res.exit_code != 0 and msg in (res.output + str(res.exception))


def test_missing_model_is_one_error_line(tmp_path):
    res = CliRunner().invoke(cli, ["sweep", "--model", str(tmp_path / "nope"), "--report-dir", str(tmp_path),
                                   "--no-progress"])
    assert res.exit_code != 0 and isinstance(res.exception, DeepInferError)
    assert "is neither a local directory nor a hub id" in str(res.exception)


def test_report_reads_without_changing_rows_and_lists_unreadable_runs(tmp_path, caplog):
    run = tmp_path / "1" / "r"
    run.mkdir(parents=True)
    rows = run / "rows.jsonl"
    rows.write_text('{"key": "a", "status": "failed"}\n{"key": "b", "sta')       # a sweep mid-append
    res = CliRunner().invoke(cli, ["report", "--all", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0 and rows.read_text().endswith('"sta') and not (run / "raw").exists()
    assert "| r | 1 | 0 / 1 |" in (tmp_path / "index.md").read_text()
    rows.write_text('{"key": "a", "status": "ok"}\nnot json\n{"key": "c", "status": "ok"}\n')
    good = tmp_path / "1" / "good"
    good.mkdir()
    (good / "rows.jsonl").write_text('{"key": "x", "status": "ok"}\n')
    for args in (["--all"], ["good"]):          # another run's corrupt row: listed as unreadable, one warning
        caplog.clear()
        res = CliRunner().invoke(cli, ["report", *args, "--report-dir", str(tmp_path), "--no-png"])
        assert res.exit_code == 0, res.output
        index = (tmp_path / "index.md").read_text()
        assert "| r (unreadable: rows.jsonl:2 is not a JSON row) | 1 |" in index and "| good | 1 | 1 / 0 |" in index
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "rows.jsonl:2: not a JSON row" in warnings[0], warnings
    res = CliRunner().invoke(cli, ["report", "r", "--report-dir", str(tmp_path)])       # named: an error
    assert res.exit_code != 0 and "rows.jsonl:2: not a JSON row" in str(res.exception)
    res = CliRunner().invoke(cli, ["report", "--all", "--report-dir", str(tmp_path / "none")])
    assert res.exit_code != 0 and "no report directory" in str(res.exception)


def test_main_job_leaves_the_checkout_clean(monkeypatch):
    """The README's main job (`deepinfer-bench sweep`, cwd = repo root) leaves `git status --porcelain` as it was:
    the new run is git-ignored and reports/index.md is not rewritten (a 2-point version of the default sweep).
    Status is compared under reports/ (all the sweep writes), untracked files included, so edits elsewhere in a
    shared working tree while the test runs cannot fail it; .ci/run checks the whole tree after the real job."""
    import shutil
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")

    def status() -> str:
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "reports"], cwd=root,
                              capture_output=True, text=True, check=True).stdout
    small = {**DEFAULT_SWEEP, "name": "tiny-cpu-cleancheck", "scenarios": [{"isl": 16, "osl": 4}],
             "concurrency": [1], "warmup": 0}
    monkeypatch.setattr(sweep_mod, "DEFAULT_SWEEP", small)
    monkeypatch.setattr(sweep_mod, "default_sweep", lambda: parse_sweep(small, "<small default sweep>"))
    monkeypatch.chdir(root)
    runs = root / "reports" / "1"
    js = root / "reports" / "plotly.min.js"
    had_js, runs_before, before = js.exists(), set(runs.iterdir()), status()
    try:
        res = CliRunner().invoke(cli, ["sweep", "--no-progress"])
        assert res.exit_code == 0, res.output
        assert "index.md not rewritten" in res.output and "deepinfer-bench report --all" in res.output
        made = set(runs.iterdir()) - runs_before
        assert len(made) == 1 and next(iter(made)).name.endswith("-tiny-cpu-cleancheck")
        assert status() == before
    finally:
        for run in set(runs.iterdir()) - runs_before:
            shutil.rmtree(run)
        if not had_js and js.exists():
            js.unlink()


def test_resume_of_an_unknown_run_and_bad_run_ids(tmp_path):
    with pytest.raises(DeepInferError, match="--resume: no sweep run"):
        run_sweep(parse_sweep(MICRO), tmp_path, "typo", resume=True, progress=False)
    with pytest.raises(DeepInferError, match="letters, digits"):
        run_sweep(parse_sweep(MICRO), tmp_path, "../escape", progress=False)
