"""`deepinfer-bench structured` on the tiny model, CPU: one row per (schema, batch, fraction) point with the
constrained / free split, the fraction-0 baseline shared per batch, bad options one line, a run directory with
rows refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.harness.rows import read_rows
from deepinfer.harness.structured_bench import StructuredConfig, output_parses, run_structured_bench, table
from tests.helpers import assert_traffic

pytest.importorskip("xgrammar")


def test_rows_split_constrained_and_free_requests(tmp_path):
    cfg = StructuredConfig(schemas=("regex", "json"), batches=(2,), fractions=(0.0, 0.5, 1.0), isl=8, osl=6,
                           rounds=1)
    rows = run_structured_bench(cfg, tmp_path / "run")
    assert [r["key"] for r in rows] == ["none/b2/f0", "regex/b2/f0.5", "regex/b2/f1", "json/b2/f0.5", "json/b2/f1"]
    by = {r["key"]: r for r in rows}
    for r in rows:
        assert_traffic(r)
    assert by["none/b2/f0"]["constrained_requests"] == 0 and by["none/b2/f0"]["free_requests"] == 2
    assert by["regex/b2/f0.5"]["constrained_requests"] == 1 and by["regex/b2/f0.5"]["free_requests"] == 1
    assert by["json/b2/f1"]["constrained_requests"] == 2 and by["json/b2/f1"]["free_mean_tpot"] is None
    assert by["none/b2/f0"]["engine"]["mask_fills"] == 0 and by["json/b2/f1"]["engine"]["mask_fills"] >= 5
    assert by["json/b2/f1"]["engine"]["mask_fill_ms_per_fill"] > 0
    for r in rows:
        assert r["status"] == "ok" and r["completed"] == 2 and r["mean_tpot"] > 0
        assert r["free_requests"] == 0 or r["free_mean_output_tokens"] == 6          # free: exactly osl tokens
        assert r["constrained_stopped_parse"] == r["constrained_stopped"]          # every completed one parses
        assert sum(r["constrained_finish_reasons"].values()) == r["constrained_requests"]
        assert "grammar_dead_end" not in r["constrained_finish_reasons"]
    lines = table(rows)
    assert len(lines) == 6
    assert lines[1].split()[:5] == ["none", "2", "0", f"{by['none/b2/f0']['median_tpot'] * 1e3:.2f}", "1.000"]
    assert json.loads((tmp_path / "run" / "structured.json").read_text())["osl"] == 6
    with pytest.raises(DeepInferError, match="already has rows"):
        run_structured_bench(cfg, tmp_path / "run")
    assert len(read_rows(tmp_path / "run")) == 5


def test_output_parses_checks_the_language():
    assert output_parses("regex", "ab cd.") and not output_parses("regex", "ab cd")
    assert output_parses("json", '{"name": "x", "tags": ["a"], "score": 1.5}')
    assert not output_parses("json", '{"name": "x"}') and not output_parses("json", "{")


@pytest.mark.parametrize("args,why", [
    (["--schemas", "yaml"], "--schemas 'yaml': choose from json, regex"),
    (["--fractions", "0,2"], "--fractions: give fractions in [0, 1]"),
    (["--fractions", "half"], "--fractions 'half': give comma-separated fractions"),
    (["--osl", "1"], "--osl must be at least 2"),
    (["--batch", "0"], "--batch '0': give a comma-separated list of integers >= 1"),
])
def test_bad_options_are_one_line(tmp_path, args, why):
    cmd = [sys.executable, "-c", "import sys; from deepinfer.harness.cli import main; sys.argv[0] = "
           "'deepinfer-bench'; main()", "structured", "--out", str(tmp_path / "r"), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    err = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and why in err[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_points_skip_fractions_that_repeat_a_count():
    cfg = StructuredConfig(schemas=("json",), batches=(1, 4), fractions=(0.0, 0.1, 0.5, 1.0))
    assert cfg.points() == [("none", 1, 0.0), ("json", 1, 1.0), ("none", 4, 0.0), ("json", 4, 0.5), ("json", 4, 1.0)]
