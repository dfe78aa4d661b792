"""The one bench runner (harness/bench.py): run folders refuse or resume, a failed point is a row (and stops the run
in one line unless it goes on), rows.identity is the one identity; the kernel bench times the kernel tables'
functions; no harness or eval code reaches into private engine state."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from deepinfer.errors import DeepInferError, did_you_mean
from deepinfer.harness.bench import OnError, RunFolder, record_point
from deepinfer.harness.rows import SCHEMA_VERSION, environment, identity, read_rows

ROOT = Path(__file__).resolve().parent.parent


def test_a_new_run_refuses_a_folder_with_rows_and_a_resumed_one_needs_its_settings(tmp_path):
    folder = RunFolder(tmp_path / "run", "bench.json")
    assert folder.check() == set()
    store = folder.open('{"a": 1}\n', environment())
    store.append({"key": "p1", "status": "ok"})
    store.append({"key": "p2", "status": "failed"})
    assert (tmp_path / "run" / "bench.json").read_text() == '{"a": 1}\n' and (tmp_path / "run" / "env.json").exists()
    with pytest.raises(DeepInferError, match="already has rows: pass --resume"):
        RunFolder(tmp_path / "run", "bench.json").check()
    with pytest.raises(DeepInferError, match="already has rows: choose a new --run-id"):
        RunFolder(tmp_path / "run", "bench.json", resumable=False).check()
    resumed = RunFolder(tmp_path / "run", "bench.json", resume=True)
    assert resumed.check(lambda text: None) == {"p1"}                 # failed points run again
    with pytest.raises(DeepInferError, match="other settings"):
        resumed.check(lambda text: "--resume: other settings")
    with pytest.raises(DeepInferError, match=r"no bench run .* \(no other.json there\)"):
        RunFolder(tmp_path / "run", "other.json", resume=True).check()


def test_a_failed_point_is_a_row_then_one_line_or_the_next_point(tmp_path):
    store = RunFolder(tmp_path / "run", None).open()
    ident = {"bench": "t"}

    def boom():
        raise RuntimeError("no memory\nmore")
    with pytest.raises(DeepInferError, match=r"point b failed \(RuntimeError: no memory\); its failure row is in "):
        record_point(store, ident, "b", {"x": 1}, boom)
    row = record_point(store, ident, "c", {}, boom, OnError(continue_on_error=True))
    assert row["status"] == "failed" and row["error"] == "RuntimeError: no memory\nmore"
    ok = record_point(store, ident, "d", {"x": 2}, lambda: ({"y": 3}, {"raw": True}))
    rows = read_rows(tmp_path / "run")
    assert [(r["key"], r["status"]) for r in rows] == [("b", "failed"), ("c", "failed"), ("d", "ok")]
    assert rows[0]["x"] == 1 and rows[0]["bench"] == "t" and rows[0]["started"] and rows[0]["finished"]
    assert ok["y"] == 3 and json.loads((tmp_path / "run" / "raw" / "d.json").read_text()) == {"raw": True}
    kept = record_point(store, ident, "e", {}, lambda: (_ for _ in ()).throw(DeepInferError("refused")),
                        OnError(keep_going=(DeepInferError,)))
    assert kept["error"] == "refused"                                   # a DeepInferError's own line


def test_identity_carries_the_run_and_its_environment():
    env = environment()
    row = identity(env, "7", bench="x", model="tiny")
    assert row["schema_version"] == SCHEMA_VERSION and row["method_version"] == "7" and row["model"] == "tiny"
    assert row["git_sha"] == env["git"]["sha"] and row["packages"] == env["packages"] and "hardware_info" not in row
    lean = identity(env, "1", packages=False, hardware_info=True)
    assert "packages" not in lean and lean["hardware_info"] == env["hardware"]


def test_kernel_bench_times_the_kernel_tables_functions():
    from deepinfer.harness.kernel_bench import implementation
    from deepinfer.kernels.table import KernelTable
    for op in ("sparse_sink_attention", "hc_mixes", "route", "grouped_experts"):
        assert implementation(op, "reference") is KernelTable("reference").fns[op]


def test_did_you_mean_is_one_hint():
    assert did_you_mean("concurency", ("concurrency", "seed"), quote=True) == "did you mean 'concurrency'?"
    assert did_you_mean(["temprature", "zzz"], ["temperature", "top_p"]) == "did you mean temperature?"
    assert did_you_mean("zzz", ["a"]) == ""


def _attribute_chains(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                names.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name):
                names.append(inner.id)
            yield node.lineno, list(reversed(names))


def test_harness_and_eval_touch_no_private_engine_state():
    """No `llm._x`, `engine._x` or runner internals (`.runner.` of an engine) from the harness or eval: they use
    the public LLM, EngineCore and StepProbe surfaces."""
    bad = []
    for path in [*sorted((ROOT / "harness").glob("*.py")), *sorted((ROOT / "eval").rglob("*.py"))]:
        for line, chain in _attribute_chains(path):
            private = any(a.startswith("_") and not a.startswith("__") for a in chain[1:])
            if chain[0] in ("llm", "engine", "lm") and private or "runner" in chain[1:]:
                bad.append(f"{path.relative_to(ROOT)}:{line} {'.'.join(chain)}")
    assert bad == []
