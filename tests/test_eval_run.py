"""deepinfer-eval end to end on CPU: the offline suite on the tiny model (rows, lm-eval results, agreement between
concurrencies), thresholds that make the exit status non-zero, bad input as one error line, the transformers
cross-check, and the reports index listing eval runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")


def eval_exe() -> str:
    exe = Path(sys.executable).parent / "deepinfer-eval"
    if not exe.exists():
        pytest.skip("deepinfer-eval is not installed (pip install -e .)")
    return str(exe)


def run(*args, env=None, cwd=None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([eval_exe(), "run", "--quiet", *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=900)


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "rows.jsonl").read_text().splitlines()]


def test_offline_smoke_suite(tmp_path):
    out = tmp_path / "reports" / "eval"
    p = run("--suite", "offline-smoke", "--out", str(out), "--run-id", "smoke", cwd=tmp_path)   # outside a checkout
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fatal:" not in p.stderr and "not a git repository" not in p.stderr, p.stderr[-2000:]
    printed = {line.split()[1] + " " + line.split()[2]: line for line in p.stdout.splitlines()
               if line.startswith("  c=8")}
    assert printed["deepinfer_choice acc,none"].endswith("no threshold")           # no bound: never "ok"
    assert printed["deepinfer_text bits_per_byte,none"].endswith("ok (>= 5.85 and <= 5.95)")
    assert "index.md not rewritten" in p.stdout and not (out.parent / "index.md").exists()
    run_dir = out / "smoke"
    for name in ("suite.yaml", "env.json", "results_c8.json", "results_c4.json", "samples_c8.jsonl",
                 "samples_c4.jsonl"):
        assert (run_dir / name).is_file(), name
    rows = rows_of(run_dir)
    assert rows[-1]["kind"] == "summary" and rows[-1]["complete"] and rows[-1]["thresholds_missed"] == 0
    rows = rows[:-1]
    metrics = {(r["concurrency"], r["task"], r["metric"]): r for r in rows if r["kind"] == "eval"}
    for c in (8, 4):            # max, and the median of 1, 2, 4, 8
        assert {"exact_match,first-integer", "acc,none", "bits_per_byte,none"} <= {m for cc, _, m in metrics if cc == c}
    checked = [r for r in rows if r["passed"] is not None]
    assert checked and all(r["passed"] for r in checked)
    agreement = [r for r in rows if r["kind"] == "agreement"]
    assert {r["task"] for r in agreement} == {"deepinfer_arith", "deepinfer_choice", "deepinfer_text"}
    assert all(r["value"] == 1.0 and r["max_abs_loglik_diff"] == 0.0 for r in agreement)   # batch-invariant mode
    for r in rows:
        assert r["schema_version"] == "1" and r["model"] == "tiny" and "git_sha" in r
        assert r["batch_invariant"] is True and r["kernel_backend"] == "invariant" and r["seed"] == 1234
        assert "packages" in r and r["config_hash"]
    result = json.loads((run_dir / "results_c8.json").read_text())
    assert set(result["results"]) == {"deepinfer_arith", "deepinfer_choice", "deepinfer_text"}
    assert result["configs"]["deepinfer_arith"]["num_fewshot"] == 2
    samples = [json.loads(line) for line in (run_dir / "samples_c8.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 16
    assert result["git_hash"] == rows[0]["git_sha"]          # the deepinfer checkout's commit, as the rows carry
    bench = Path(sys.executable).parent / "deepinfer-bench"
    subprocess.run([str(bench), "report", "--all", "--report-dir", str(out.parent)], check=True,
                   capture_output=True, timeout=300)                 # publishing: only report writes the index
    index = (out.parent / "index.md").read_text()
    assert "## Eval runs (deepinfer-eval)" in index and "| smoke | offline-smoke | tiny |" in index


def test_default_mode_and_agreement_of_scores(tmp_path):
    """--no-batch-invariant runs the engine's default mode (rows say so); perplexity samples are compared by their
    logliks, so a changed score is a disagreement."""
    from deepinfer.evals.run import agreement_rows
    p = run("--tasks", "deepinfer_text", "--limit", "2", "--max-num-seqs", "4", "--max-model-len", "256",
            "--no-batch-invariant", "--out", str(tmp_path / "eval"), "--run-id", "d")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = rows_of(tmp_path / "eval" / "d")
    assert all(r["batch_invariant"] is False and r["kernel_backend"] == "reference" for r in rows)
    a = {"t": [{"doc_id": 0, "resps": [[-10.0]], "filtered_resps": [-10.0]}]}
    b = {"t": [{"doc_id": 0, "resps": [[-10.5]], "filtered_resps": [-10.5]}]}
    assert agreement_rows(a, a, None, {})[0]["value"] == 1.0
    row = agreement_rows(a, b, None, {})[0]
    assert row["value"] == 0.0 and row["max_abs_loglik_diff"] == 0.5


def test_threshold_miss_exits_nonzero(tmp_path):
    suite = tmp_path / "strict.yaml"
    suite.write_text("name: strict\nmodel: tiny\nengine_args: {max_num_seqs: 4, max_model_len: 256}\n"
                     "tasks: [deepinfer_choice]\nlimit: 4\n"
                     "thresholds: {deepinfer_choice: {acc: {min: 0.99}}}\n")
    p = run("--suite", str(suite), "--out", str(tmp_path / "eval"), "--run-id", "strict")
    assert p.returncode == 1, p.stderr[-2000:]
    assert "1 threshold(s) missed: deepinfer_choice acc,none" in p.stderr and "wants >= 0.99" in p.stderr
    bad = [r for r in rows_of(tmp_path / "eval" / "strict") if r.get("passed") is False]
    assert len(bad) == 1 and bad[0]["metric"] == "acc,none"


@pytest.mark.parametrize("args, fragment", [
    (["--tasks", "deepinfer_arithh"], "unknown task 'deepinfer_arithh': did you mean deepinfer_arith"),
    (["--suite", "nope"], "unknown suite 'nope'; suites:"),
    (["--tasks", "arc_easy"], "task arc_easy: cannot load it"),
    (["--suite", "offline-smoke", "--concurrency", "most"], "concurrency[0]: got 'most'"),
])
def test_bad_input_is_one_line(tmp_path, args, fragment):
    empty = {"HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "HF_HOME": str(tmp_path / "hf")}  # nothing cached
    p = run(*args, "--out", str(tmp_path / "eval"), env=empty)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    if "arc_easy" in args:
        assert "hub" in lines[0] and "offline-smoke" in lines[0]      # names the task and the fix


def test_code_executing_tasks_need_consent(tmp_path):
    suite = tmp_path / "unsafe.yaml"
    suite.write_text("name: unsafe\nmodel: tiny\ntasks: [{task: deepinfer_arith, unsafe_code: true}]\nlimit: 2\n")
    p = run("--suite", str(suite), "--out", str(tmp_path / "eval"))
    assert p.returncode == 2 and "executes model-written code" in p.stderr and "--confirm-run-unsafe-code" in p.stderr
    p = run("--suite", str(suite), "--out", str(tmp_path / "eval"), "--confirm-run-unsafe-code",
            env={"HF_ALLOW_CODE_EVAL": "0"})
    assert p.returncode == 2 and "set HF_ALLOW_CODE_EVAL=1" in p.stderr, p.stderr[-2000:]


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = run("--tasks", "deepinfer_text", "--out", str(blocker / "eval"))
    assert p.returncode == 2 and p.stderr.startswith("error: ") and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_missing_offline_data_file(tmp_path, monkeypatch):
    import shutil

    from deepinfer.evals import tasks
    from deepinfer.evals.suite import TaskSpec
    copy = tmp_path / "tasks"
    shutil.copytree(tasks.TASKS_DIR, copy, ignore=shutil.ignore_patterns("*.jsonl", "__pycache__"))
    monkeypatch.setattr(tasks, "TASKS_DIR", copy)
    with pytest.raises(tasks.TaskError, match=r"task deepinfer_arith: data file .*arith.jsonl is missing; "
                                              r"regenerate it with `python -m deepinfer.evals.tasks.make_data`"):
        tasks.task_configs([TaskSpec("deepinfer_arith")], lambda _: None)


def test_offline_data_is_reproducible(tmp_path, monkeypatch):
    from deepinfer.evals.tasks import TASKS_DIR, make_data
    monkeypatch.setattr(make_data, "DATA", tmp_path)
    make_data.main()
    for f in ("arith.jsonl", "choice.jsonl", "text.jsonl"):
        assert (tmp_path / f).read_bytes() == (TASKS_DIR / "data" / f).read_bytes()


@pytest.mark.usefixtures("transformers_v4_reference")
def test_reference_transformers_cross_check(tmp_path):
    pytest.importorskip("accelerate")
    from deepinfer.checkpoint.make import make_checkpoint
    ck = make_checkpoint("deepseek_v4", "tiny", "hf", seed=3, out=tmp_path / "v4hf")
    p = run("--tasks", "deepinfer_choice,deepinfer_text", "--model", str(ck), "--limit", "3", "--max-model-len",
            "256", "--max-num-seqs", "4", "--reference", "transformers", "--out", str(tmp_path / "eval"),
            "--run-id", "ref")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = rows_of(tmp_path / "eval" / "ref")
    assert all(r["qat_fake_quant"] is False for r in rows)
    ref = {r["task"]: r for r in rows if r["kind"] == "reference_agreement"}
    assert set(ref) == {"deepinfer_choice", "deepinfer_text"}
    assert ref["deepinfer_choice"]["value"] == 1.0 and ref["deepinfer_text"]["value"] == 1.0   # text: logliks
    assert all(r["max_abs_loglik_diff"] <= 1e-3 for r in ref.values()), ref
    assert (tmp_path / "eval" / "ref" / "results_reference.json").is_file()
    # the V4.1 tiny default has no transformers twin: one clear line
    p = run("--tasks", "deepinfer_text", "--reference", "transformers", "--out", str(tmp_path / "eval2"))
    assert p.returncode == 2 and "needs a V4 checkpoint directory in Hugging Face layout" in p.stderr
