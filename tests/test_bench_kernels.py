"""`deepinfer-bench kernels` on CPU: the reference backend's rows at released expert and projection shapes (a few
experts only), every field a row promises, errors of 0 against itself, --resume skipping done rows, and bad
options refused in one line before anything is written. (GPU rows: docs/results.md.)"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from deepinfer.harness.cli import cli
from deepinfer.harness.kernel_bench import expert_traffic, random_expert_weights
from tests.bad_input import refuse_cli

FIELDS = {"key", "op", "backend", "tokens", "time_ms", "bytes", "flops", "tb_per_s", "tflop_per_s", "bandwidth_share",
          "memory_bound_ms", "timing", "reference_ms", "err_vs_reference", "ceilings", "status", "git_sha"}


def _run(args):
    result = CliRunner().invoke(cli, ["kernels", "--device", "cpu", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_expert_rows_on_cpu_and_resume(tmp_path):
    out = tmp_path / "k"
    args = ["--op", "experts", "--model", "v4", "--storage", "fp4,bf16", "--numerics", "a16,a8", "--tokens", "1,2",
            "--experts-limit", "8", "--backend", "reference", "--iters", "1", "--warmup", "0", "--out", str(out)]
    text = _run(args)
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    keys = [r["key"] for r in rows]
    # fp4 x (a16, a8) + bf16 x a16, two token counts; bf16 has no a8
    assert sorted(keys) == sorted(f"experts/v4/{s}/{n}/t{t}/reference" for s, n in
                                  (("fp4", "a16"), ("fp4", "a8"), ("bf16", "a16")) for t in (1, 2))
    for r in rows:
        assert FIELDS <= set(r) and r["status"] == "ok" and r["timing"] == "eager"
        assert r["err_vs_reference"] == 0.0                  # the reference against itself, same inputs
        assert r["experts_touched"] <= 6 * r["tokens"] and r["time_ms"] > 0
    a8 = [r for r in rows if r["numerics"] == "a8"]
    assert all(r["err_vs_a16"] is not None and r["err_vs_a16"] > 0 for r in a8)    # W4A8 differs from W4A16
    assert "experts/v4/fp4/a16/t1/reference" in text
    _run(args + ["--resume"])                                 # nothing left to do: no new rows
    assert len((out / "rows.jsonl").read_text().splitlines()) == len(rows)


def test_attention_rows_on_cpu(tmp_path):
    """Every layer kind at a small context, the reference against itself; keys per row as each kind reads them."""
    out = tmp_path / "a"
    _run(["--op", "attention", "--tokens", "1,3", "--contexts", "512", "--backend", "reference", "--iters", "1",
          "--warmup", "0", "--out", str(out)])
    rows = {r["key"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    assert set(rows) == {f"attention/{k}/c512/t{t}/reference" for k in ("swa", "csa", "hca") for t in (1, 3)}
    assert {k: rows[f"attention/{k}/c512/t3/reference"]["keys_per_row"] for k in ("swa", "csa", "hca")} == \
        {"swa": 128, "csa": 128 + 128, "hca": 128 + 4}                      # csa: 512 of 512/4 = all 128 entries
    for r in rows.values():
        assert FIELDS <= set(r) and r["err_vs_reference"] == 0.0 and r["ran"] == "reference"
        assert r["bytes"] == r["tokens"] * r["keys_per_row"] * 512 * 2 + 2 * r["tokens"] * 64 * 512 * 2
        assert r["flops"] == 4 * r["tokens"] * 64 * r["keys_per_row"] * 512


def test_mhc_and_route_rows_on_cpu(tmp_path):
    """hc_mixes and route at the released widths, the reference against itself; bytes and FLOPs as stored."""
    out = tmp_path / "m"
    _run(["--op", "mhc,route", "--tokens", "1,3", "--backend", "reference", "--iters", "1", "--warmup", "0",
          "--out", str(out)])
    rows = {r["key"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    assert set(rows) == {f"{op}/{m}/t{t}/reference" for op in ("mhc", "route") for m in ("v41", "v4")
                         for t in (1, 3)}
    for r in rows.values():
        assert r["err_vs_reference"] == 0.0 and r["time_ms"] > 0
    assert rows["mhc/v41/t3/reference"]["flops"] == 2 * 3 * 4 * 5120 * 24
    assert rows["route/v4/t3/reference"]["bytes"] == (3 + 256) * 4096 * 2


def test_traffic_counts_stored_bytes():
    import torch
    gen = torch.Generator().manual_seed(0)
    ew = random_expert_weights("fp4", 4, 64, 32, False, "cpu", gen)
    nbytes, flops = expert_traffic(ew, rows=3, touched=2)
    per_expert = 3 * 64 * 32 // 2 + 3 * 64 * 32 // 32        # packed e2m1 + e8m0 scales
    assert nbytes == 2 * per_expert + 3 * 64 * 2 + 2 * 3 * 32 * 2 + 3 * 64 * 4
    assert flops == 6 * 3 * 64 * 32


@pytest.mark.parametrize("args,match", [
    (["--op", "mla"], r"--op mla: use one or more of experts, fp8_linear, attention"),
    (["--contexts", "0"], r"--contexts"),
    (["--storage", "int4"], r"--storage int4: use one or more of fp4, fp8, bf16"),
    (["--tokens", "0"], r"--tokens"),
    (["--experts-limit", "0"], r"--experts-limit must be at least 1, got 0"),
    (["--op", "experts,experts"], r"--op 'experts,experts' lists experts twice"),
    (["--resume", "--backend", "reference"], r"--resume: no kernel run"),
    (["--backend", "triton"], r"--backend triton runs Triton kernels on CUDA only; on cpu use --backend reference"),
])
def test_bad_options_are_one_line(tmp_path, args, match):
    refuse_cli(cli, ["kernels", "--device", "cpu", "--out", str(tmp_path / "k"), *args], match, watch=[tmp_path])
