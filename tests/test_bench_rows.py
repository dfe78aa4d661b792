"""The row store: durable appends, resume after a torn write, corrupt lines never dropped, failures retried, raw
files atomic, clear errors; the run-folder guard; git state that ignores reports/."""

import json
import shutil
import subprocess

import pytest

from deepinfer.harness.rows import (SCHEMA_VERSION, CorruptRowError, ReportDirError, RowStore, atomic_write_text,
                                    environment, git_state, read_rows, run_dir_guard)


def test_append_resume_and_torn_tail(tmp_path):
    store = RowStore(tmp_path / "run")
    store.append({"key": "decode/c1", "status": "ok", "schema_version": SCHEMA_VERSION, "x": 1.5})
    store.append({"key": "decode/c2", "status": "failed", "error": "boom"})
    store.append({"key": "decode/c4", "status": "ok"})
    with open(store.path, "a") as f:                 # a kill -9 in the middle of the next append
        f.write('{"key": "decode/c8", "sta')
    again = RowStore(tmp_path / "run")
    assert again.done_keys() == {"decode/c1", "decode/c4"}           # the failure is retried, the torn row gone
    assert [r["key"] for r in again.rows()] == ["decode/c1", "decode/c2", "decode/c4"]
    assert again.path.read_text().endswith("\n")
    again.append({"key": "decode/c8", "status": "ok"})
    assert len(RowStore(tmp_path / "run").rows()) == 4


@pytest.mark.parametrize("line, why", [
    (b'{"key": "b", ', "invalid JSON"),                # a complete line: corruption, not a torn write
    (b'[1, 2]', "a JSON list, not an object"),
    (b'{"x": 1}', "an object without 'key' and 'status'"),
    (b'"\xff\xfe"', "not UTF-8"),
])
def test_a_corrupt_complete_line_is_an_error_and_kept(tmp_path, line, why):
    store = RowStore(tmp_path)
    store.append({"key": "a", "status": "ok"})
    with open(store.path, "ab") as f:
        f.write(line + b"\n")                          # the last line, newline-terminated
    before = store.path.read_bytes()
    for call in (lambda: RowStore(tmp_path), lambda: read_rows(tmp_path)):
        with pytest.raises(CorruptRowError, match=f"rows.jsonl:2: not a JSON row \\(({why})"):
            call()
    assert store.path.read_bytes() == before            # the writer did not drop it


def test_corrupt_middle_line_with_a_torn_tail(tmp_path):
    store = RowStore(tmp_path)
    store.append({"key": "a", "status": "ok"})
    with open(store.path, "a") as f:
        f.write('not json\n{"key": "c", "status": "ok"}\n{"key": "d", "sta')
    before = store.path.read_bytes()
    with pytest.raises(CorruptRowError) as info:
        RowStore(tmp_path)
    assert info.value.line == 2 and info.value.short == "rows.jsonl:2 is not a JSON row"
    assert store.path.read_bytes() == before            # checked before the torn tail is cut: nothing changed


def test_run_dir_guard(tmp_path):
    run = tmp_path / "new" / "1" / "r"
    with pytest.raises(RuntimeError):
        with run_dir_guard(run):
            RowStore(run)
            raise RuntimeError("model failed to load")
    assert not (tmp_path / "new").exists()              # everything this invocation made is gone
    with pytest.raises(KeyboardInterrupt):
        with run_dir_guard(run):
            RowStore(run).append({"key": "a", "status": "failed"})
            raise KeyboardInterrupt
    assert read_rows(run) == [{"key": "a", "status": "failed"}]     # a run with rows stays
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError):
        with run_dir_guard(existing):
            RowStore(existing)
            raise RuntimeError
    assert existing.is_dir()                            # a folder that was there before stays


def test_rows_need_key_and_status_and_store_no_samples_as_null(tmp_path):
    store = RowStore(tmp_path)
    with pytest.raises(ValueError, match="'key' and 'status'"):
        store.append({"key": "a"})
    store.append({"key": "a", "status": "ok", "x": float("nan"), "y": [float("inf"), 1.0]})
    assert store.rows() == [{"key": "a", "status": "ok", "x": None, "y": [None, 1.0]}]   # no samples: null


def test_raw_files_are_atomic(tmp_path):
    store = RowStore(tmp_path)
    path = store.write_raw("decode/isl128-osl32/c4", {"ttfts": [0.1, 0.2]})
    assert path.name == "decode__isl128-osl32__c4.json" and json.loads(path.read_text()) == {"ttfts": [0.1, 0.2]}
    atomic_write_text(path, "{}")
    assert path.read_text() == "{}" and not list(path.parent.glob(".*tmp*"))


def test_unwritable_report_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ReportDirError, match="cannot write the report directory .*--report-dir"):
        RowStore(blocker / "run")


def test_environment_identity(no_engine_switches):
    monkeypatch = no_engine_switches
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "0")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL", "1")          # its default: not a switch away from it
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")         # the device: a row field of its own
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", "/")          # a path: never in a row
    env = environment()
    assert set(env) == {"git", "packages", "hardware", "time", "engine_env"}
    assert env["engine_env"] == {"DEEPINFER_ASYNC_SCHEDULING": False}
    assert env["packages"]["torch"] and env["hardware"]["cpu_count"] >= 1
    assert set(env["git"]) == {"sha", "dirty"}


def test_git_state_describes_the_code_not_the_reports(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("no git")
    repo = tmp_path / "repo"
    (repo / "reports").mkdir(parents=True)
    (repo / "pkg").mkdir()
    (repo / "pkg" / "code.py").write_text("x = 1\n")
    (repo / "reports" / "index.md").write_text("runs\n")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "init")
    assert git_state(repo / "pkg") == {"sha": git_state(repo)["sha"], "dirty": False}
    (repo / "reports" / "index.md").write_text("rewritten\n")       # results changed: the code did not
    (repo / "reports" / "new.json").write_text("{}")
    assert git_state(repo / "pkg")["dirty"] is False and git_state(repo)["dirty"] is False
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    assert git_state(repo / "pkg")["dirty"] is True
    assert git_state(tmp_path) == {"sha": None, "dirty": None}       # not a checkout: nothing, and nothing printed
