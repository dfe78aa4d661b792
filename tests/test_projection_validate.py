"""The projection's validation (harness/projection/opmodel.py, kernel_rates.py, validate.py; docs/projection.md,
"Validation"): the op model on hand-computed ops, the kernel rates' lookup, and the error table rerun from the
committed data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.harness.cli import cli as bench_cli
from deepinfer.harness.projection import comm, hardware
from deepinfer.harness.projection.comm import AlphaBeta
from deepinfer.harness.projection.kernel_rates import kernels
from deepinfer.harness.projection.opmodel import (SHAPES, Deployment, decode_ops, experts_per_rank,
                                                  project_ops)
from deepinfer.harness.projection.step import overlapped
from deepinfer.harness.projection.validate import (load_anchors, markdown, run_validation, table_lines, validate,
                                                   write_table)
from tests.bad_input import refuse_cli

ROOT = Path(__file__).resolve().parents[1]
V3 = SHAPES["v3"]


@pytest.fixture(scope="module")
def data():
    anchors = load_anchors()
    return anchors, kernels(anchors["kernel_rates"]), hardware.profiles()


# ---- the op model: one op's bytes and FLOPs by hand ----
def test_ops_by_hand_at_lmsys_shape(data):
    """EP72 with 32 redundant experts, 256 sequences a GPU at KV 2,000, two micro-batches of 128 rows."""
    dep = Deployment("H100", ep=72, batch=256, context=2000, redundant_experts=32)
    ops = {o.name: o for o in decode_ops(V3, dep)}
    o = ops["o"]                                       # 128 x 16384 @ 16384 x 7168, FP8 weights + 128x128 scales
    assert o.calls == 61 * 2 and o.flops == 2 * 128 * 16384 * 7168
    assert o.nbytes == 16384 * 7168 + (7168 // 128) * (16384 // 128) * 4 + 128 * 16384 + 128 * 7168 * 2
    attn = ops["attention (FlashMLA)"]                 # 128 sequences x 2,000 cached 576-wide BF16 latents
    assert attn.flops == 2 * 128 * 128 * 2000 * (576 + 512)
    assert attn.nbytes == 128 * 2000 * 1152 + 128 * 128 * (576 + 512) * 2
    assert experts_per_rank(V3, dep) == 4              # ceil(288 / 72)
    up = ops["experts gate_up (masked)"]               # 1,024 pairs over 4 experts: 256 rows each
    assert up.m == 256 and up.flops == 2 * 1024 * 4096 * 7168 and up.calls == 58 * 2
    assert up.nbytes == 4 * (4096 * 7168 + 32 * 56 * 4) + 1024 * 7168 + 1024 * 4096 * 2
    assert ops["lm head"].calls == 1 and ops["lm head"].flops == 2 * 256 * 129280 * 7168
    assert "dense gate_up" in ops and not any(n.startswith("draft") for n in ops)


def test_op_time_is_the_published_kernel_time(data):
    """At a published DeepGEMM shape on the GPU it was published on, an op takes the published time."""
    _, rates, profiles = data
    h800 = profiles["H800"]
    gemm = rates["deepgemm_fp8_gemm"]
    flops, nbytes = 2 * 128 * 16384 * 7168, 16384 * 7168 + 128 * 16384 + 128 * 7168 * 2
    t = gemm.rate(128, 7168, 16384, h800, h800).time_s(flops, nbytes)
    assert t == pytest.approx(flops / 645e12)        # the row: 645 TFLOPS, 2,604 GB/s (same time, rounded)
    assert t == pytest.approx(nbytes / 2604e9, rel=1e-3)
    # half way in log2(m) between the 64 and 128 rows: the rates' mean
    mid = gemm.rate(math.sqrt(64 * 128), 7168, 16384, h800, h800)
    assert mid.flops_per_s == pytest.approx((336 + 645) / 2 * 1e12) and mid.flags == ()
    # outside the rows: the edge's rates, said; an unpublished (n, k): the nearest weight size's rows, said
    assert "m 8 outside the published 64-4096" in gemm.rate(8, 7168, 16384, h800, h800).flags[0]
    assert "(36864, 7168) not published" in gemm.rate(128, 36864, 7168, h800, h800).flags[0]
    # another GPU: the publishing GPU's rates x hardware.json's ratio
    h200 = profiles["H200"]
    on = gemm.rate(128, 7168, 16384, h200, h800)
    assert on.bytes_per_s == pytest.approx(2604e9 * h200.memory_bytes_per_s / h800.memory_bytes_per_s)
    assert on.flops_per_s == pytest.approx(645e12 * h200.fp8_flops_per_s / h800.fp8_flops_per_s)
    flash = rates["flashmla_bf16_decode"].rate(0, 0, 0, h800, h800)      # peaks: a roofline of its own
    assert (flash.flops_per_s, flash.bytes_per_s) == (660e12, 3000e9)
    ceil = rates["gemm_bf16"].rate(256, 129280, 7168, h800, h800)
    assert (ceil.flops_per_s, ceil.bytes_per_s) == (h800.bf16_flops_per_s, h800.memory_bytes_per_s)


def test_projected_step_sums_ops_and_overlaps_as_project_decode(data):
    _, rates, profiles = data
    flat = AlphaBeta("deepep_ll", "rdma", "dispatch", 10.0, {8: 1e9}, "fit")      # 10 us + bytes / 1 GB/s
    fits = {("deepep_ll", "rdma", op): flat for op in ("dispatch", "combine")}
    dep = Deployment("H800", ep=16, batch=64, context=1000, query_tokens=2, draft_layers=1, tokens_per_step=1.8)
    got = project_ops(V3, dep, profiles["H800"], profiles, rates, fits)
    assert got.compute_ms == pytest.approx(sum(got.op_ms.values()))
    assert any(name.startswith("draft ") for name in got.op_ms)
    # 58 MoE layers at 64 rows a micro-batch (2 per sequence), the draft layer at 32, both micro-batches
    per_row = 8 * (7168 + 56 * 4) + 8 * 7168 * 2                        # dispatch + combine bytes per token
    comm_us = 58 * 2 * (2 * 10 + 64 * per_row / 1e3) + 1 * 2 * (2 * 10 + 32 * per_row / 1e3)
    assert got.comm_ms == pytest.approx(comm_us / 1e3)
    assert got.step_ms == pytest.approx(overlapped(got.compute_ms, got.comm_ms, 59, "two_micro_batches"))
    assert got.serial_step_ms == pytest.approx(got.compute_ms + got.comm_ms)
    assert got.output_tok_s_per_gpu == pytest.approx(64 * 1.8 / got.step_ms * 1e3)
    assert any("EP 16 outside the measured 8-8" in f for f in got.flags)
    with pytest.raises(DeepInferError, match="comm.json has no deepep_ll/nvlink/dispatch"):
        project_ops(V3, Deployment("H800", ep=8, batch=64, context=1000), profiles["H800"], profiles, rates, fits)
    with pytest.raises(DeepInferError, match="kv_cache 'fp4'"):
        decode_ops(V3, Deployment("H800", ep=8, batch=64, context=1000, kv_cache="fp4"))


# ---- the validation: rerun from the committed data ----
def test_validation_reruns_and_writes_the_table(tmp_path):
    rows, provenance = run_validation(ROOT / "reports")
    kinds = {r.kind for r in rows}
    assert kinds == {"published", "own"} and "anchors.json v2" in provenance
    ids = {r.anchor for r in rows}
    assert {"deepseek-v3-production", "lmsys-96xh100-ep72", "vllm-h200-wide-ep", "sglang-4xh200-v4-flash"} <= ids
    for r in rows:            # every row: within its bound, or a cause
        assert r.within or r.cause, r.anchor
        if r.within is None:
            assert r.cause.startswith("not reproducible: ") and r.projected_tok_s_per_gpu is None
        else:
            assert r.error == pytest.approx(r.projected_tok_s_per_gpu / r.published_tok_s_per_gpu - 1)
            assert r.bound == (0.15 if r.kind == "published" else 0.10)
    lmsys = next(r for r in rows if r.anchor == "lmsys-96xh100-ep72")
    assert lmsys.published_tok_s_per_gpu == pytest.approx(22282 / 8)
    written = write_table(rows, provenance, tmp_path)
    again = write_table(rows, provenance, tmp_path / "again")
    assert [p.read_text() for p in written] == [p.read_text() for p in again]      # deterministic
    assert [p.name for p in written] == ["validation.md", "validation.csv"]
    csv_lines = written[1].read_text().splitlines()
    assert csv_lines[0] == f"# {provenance}" and len(csv_lines) == len(rows) + 2
    assert len(table_lines(rows)) == len(rows) + 1
    committed = ROOT / "reports" / "projection" / "validation.md"
    assert committed.read_text() == markdown(rows, provenance), \
        "reports/projection/validation.md is stale: rerun `deepinfer-bench projection validate`"


def test_missing_data_is_one_line(tmp_path):
    with pytest.raises(DeepInferError, match="no hardware file at") as err:
        validate(tmp_path, hardware_file=tmp_path / "nope.json")
    assert "\n" not in str(err.value)
    with pytest.raises(DeepInferError, match="no calibration rows at"):
        validate(tmp_path)                            # no reports/1/<run> of the own points here
    assert not (tmp_path / "projection").exists()
    refuse_cli(bench_cli, ["projection", "validate", "--report-dir", str(tmp_path), "--comm-file",
                           str(tmp_path / "nope.json")], "no comm file at", watch=[tmp_path])
    bad = tmp_path / "anchors.json"
    bad.write_text('{"version": 1, "bounds": {}, "kernel_rates": {}, "published": [{"id": "x"}], "own": []}')
    with pytest.raises(DeepInferError, match=r"published anchor x lacks \["):
        load_anchors(bad)


def test_packaged_comm_has_the_series_the_anchors_use():
    fits = comm.fit(comm.load()["series"])
    assert ("deepep_ll", "rdma", "dispatch") in fits and ("deepep_ll", "rdma", "combine") in fits
