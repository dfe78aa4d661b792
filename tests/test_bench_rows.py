"""The row store: durable appends, resume after a torn write, failures retried, raw files atomic, clear errors."""

import json

import pytest

from deepinfer.harness.rows import SCHEMA_VERSION, ReportDirError, RowStore, atomic_write_text, environment


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


def test_torn_line_with_newline_is_dropped(tmp_path):
    store = RowStore(tmp_path)
    store.append({"key": "a", "status": "ok"})
    with open(store.path, "a") as f:
        f.write('{"key": "b", \n')
    assert RowStore(tmp_path).done_keys() == {"a"}


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


def test_environment_identity():
    env = environment()
    assert set(env) == {"git", "packages", "hardware", "time"}
    assert env["packages"]["torch"] and env["hardware"]["cpu_count"] >= 1
    assert set(env["git"]) == {"sha", "dirty"}
