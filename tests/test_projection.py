"""The projection's terms on hand-computed cases (harness/projection, docs/projection.md)."""

from __future__ import annotations

import json

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.harness.projection import comm, hardware
from deepinfer.harness.projection.calibration import Calibration
from deepinfer.harness.projection.step import ModelShape, project_decode


# ---- comm: alpha-beta ----
def test_line_fit_by_hand():
    assert comm.line_fit([1, 3], [3, 7]) == (1.0, 2.0)
    assert comm.line_fit([1, 2], [1, 5])[0] == 0.0            # a negative intercept is clamped
    with pytest.raises(DeepInferError, match="two different sizes"):
        comm.line_fit([2, 2], [1, 5])


def _series(backend, op, points, link="nvlink", bytes_per_copy=1000, top_k=1):
    return {"backend": backend, "link": link, "op": op, "hidden": 500, "top_k": top_k,
            "bytes_per_copy": bytes_per_copy, "points": points, "source": "test"}


def test_fit_recovers_an_exact_alpha_beta_and_borrows_alpha():
    # t = 10 us + bytes / 1e9 B/s: 1000 B per token -> 1 us per token
    exact = _series("x", "dispatch", [[8, t, 10 + t] for t in (10, 100, 400)])
    # one token count per EP: alpha comes from the same backend's sweep; EP 8 -> 2 us per token, EP 32 -> 4
    wide = _series("x", "combine", [[8, 100, 210], [32, 100, 410]], link="rdma")
    fits = comm.fit([exact, wide])
    a = fits[("x", "nvlink", "dispatch")]
    assert a.alpha_us == pytest.approx(10) and a.beta[8] == pytest.approx(1e9)
    assert a.alpha_from == "fit" and max(map(abs, a.residuals)) < 1e-12
    b = fits[("x", "rdma", "combine")]
    assert b.alpha_from == "x/nvlink/dispatch" and b.beta == {8: pytest.approx(5e8), 32: pytest.approx(2.5e8)}
    # EP 16: half way in log2 between 1/5e8 and 1/2.5e8 -> 3 us per 1000 B
    est = b.time(16, 100_000)
    assert est.us == pytest.approx(10 + 300) and est.flags == ("alpha from x/nvlink/dispatch",)
    out = b.time(64, 100_000)                                   # outside: EP 32's bandwidth, said
    assert out.us == pytest.approx(10 + 400) and "EP 64 outside the measured 8-32" in out.flags[1]


def test_fit_refuses_series_without_a_floor():
    with pytest.raises(DeepInferError, match="no token-count sweep gives its floor"):
        comm.fit([_series("y", "dispatch", [[8, 100, 50]])])
    with pytest.raises(DeepInferError, match="under its floor"):
        comm.fit([_series("z", "dispatch", [[8, 10, 20], [8, 20, 30]]), _series("z", "combine", [[8, 1, 5]])])


def test_packaged_comm_data_fits_its_sweeps():
    """The one series with a token sweep (DeepEP low-latency dispatch on 8 x H100) is a line within 5% at each of
    its 5 points (2 parameters), and the RDMA table's bandwidth at EP >= 64 is the ConnectX-7 link's (~50 GB/s)."""
    data = comm.load()
    assert data["version"] == 2 and all(s["source"] for s in data["series"])
    fits = comm.fit(data["series"])
    sweep = fits[("deepep_ll", "nvlink", "dispatch")]
    assert len(sweep.residuals) == 5 and max(map(abs, sweep.residuals)) < 0.05
    assert 15 < sweep.alpha_us < 45
    for op in ("dispatch", "combine"):
        rdma = fits[("deepep_ll", "rdma", op)]
        assert all(38e9 < rdma.beta[ep] < 60e9 for ep in (64, 128, 256))
    # DeepEP's normal kernels: a bandwidth table, taken as published with no floor
    normal = fits[("deepep_normal", "rdma", "dispatch")]
    assert normal.alpha_from == "stated" and normal.beta[64] == 51e9 and normal.alpha_us == 0
    assert normal.time(64, 51e9 * 1e-6).us == pytest.approx(1.0)
    assert normal.time(64, 1.0).flags == ("alpha 0 us as the source states",)


# ---- hardware profiles ----
def test_profiles_load_and_match_torch_names():
    known = hardware.profiles()
    assert {"H200", "H100", "H800", "B200", "GB200"} <= set(known)
    assert all(p.compute_source.split(":")[0] in ("measured", "published", "ratio") for p in known.values())
    assert hardware.match("NVIDIA H100 80GB HBM3").name == "H100"
    assert hardware.match("NVIDIA H200").name == "H200"
    assert hardware.match("NVIDIA A100-SXM4-80GB") is None
    assert known["H200"].link(8) == "nvlink" and known["H200"].link(64) == "rdma" and known["GB200"].link(64) == "nvlink"
    with pytest.raises(DeepInferError, match=r"no hardware profile 'X9': use one of \["):
        hardware.profile("X9")


# ---- calibration rows ----
def _row(ep, batch, context, ms, graphed=True, idle=None, pairs=None):
    r = {"bench": "step", "status": "ok", "query_len": 1, "model": "random:m", "hardware": "NVIDIA H100", "layers": 4,
         "run_id": "cal", "started": "2026-12-06", "ep_size": ep, "ep_rank": 0, "batch": batch, "context": context,
         "graphed": graphed, "gpu_idle_fraction": idle, "step_ms_median": ms,
         "bytes": {"experts": 250, "total": 1000}, "expert_parallel": None}
    if pairs is not None:
        r["expert_parallel"] = {"layers": {f"l{i}": {"pairs_per_rank": p} for i, p in enumerate(pairs)}}
    return r


def _calibration(tmp_path, rows) -> Calibration:
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Calibration.from_run(tmp_path)


def test_calibration_interpolates_and_flags(tmp_path):
    cal = _calibration(tmp_path, [_row(8, 16, 1000, 2.0, pairs=[[10, 20], [30, 30]]), _row(8, 64, 1000, 5.0),
                                  _row(8, 16, 3000, 3.0), _row(8, 64, 3000, 8.0), _row(1, 16, 1000, 4.0, False, 0.75)])
    assert cal.lookup(8, 32, 1000).busy_ms == pytest.approx(3.0) and cal.lookup(8, 32, 1000).flags == ()
    mid = cal.lookup(8, 64, 2000)                               # context half way: (5 + 8) / 2
    assert mid.busy_ms == pytest.approx(6.5)
    # busiest rank: max pairs 20 + 30 over own 10 + 30
    assert cal.lookup(8, 16, 1000).busiest_over_own == pytest.approx(50 / 40)
    far = cal.lookup(8, 256, 500)                               # the line through batch 16 and 64: 5 + 192 x 3 / 48
    assert far.busy_ms == pytest.approx(17.0)
    assert any("batch 256 above the measured 16-64: the line through batch 16 and 64" in f for f in far.flags)
    assert any("context 500 outside the measured 1000-3000" in f for f in far.flags)
    assert cal.lookup(8, 8, 1000).busy_ms == pytest.approx(2.0)     # below the smallest batch: its value
    eager = cal.lookup(1, 16, 1000)                             # eager: median x (1 - idle)
    assert eager.busy_ms == pytest.approx(1.0) and any("eager rows" in f for f in eager.flags)
    with pytest.raises(DeepInferError, match=r"no EP 16 rank view \(it has EP \[1, 8\]\)"):
        cal.lookup(16, 16, 1000)


def test_calibration_scales_context_by_the_state_bytes(tmp_path):
    row = _row(8, 16, 1000, 2.0)
    row["bytes"] = {"experts": 250, "state": 500, "total": 1000}
    cal = _calibration(tmp_path, [row])
    # context 3000: state 500 -> 1500 bytes, total 1000 -> 2000: twice the time, said in the flags
    long = cal.lookup(8, 16, 3000)
    assert long.busy_ms == pytest.approx(4.0) and long.total_bytes == pytest.approx(2000)
    assert long.flags == ("context 3000 outside the measured 1000-1000: context 1000's time x its roofline bytes at "
                          "3000 (2x)",)


def test_calibration_refuses_unusable_runs(tmp_path):
    with pytest.raises(DeepInferError, match="no calibration rows at"):
        Calibration.from_run(tmp_path / "nowhere")
    with pytest.raises(DeepInferError, match="an eager step without a GPU trace"):
        _calibration(tmp_path, [_row(1, 1, 10, 1.0, graphed=False, idle=None)])


# ---- the projected step ----
def test_projected_step_by_hand(tmp_path):
    cal = _calibration(tmp_path, [_row(8, 16, 1000, 2.0)])      # 4 layers, experts 1/4 of 1000 bytes
    h = hardware.profile("H100")
    # hidden 128, vocab 1 (head ~0 of the bytes), 8 layers: twice the calibrated depth; top-1
    shape = ModelShape(hidden=128, vocab=1, layers=8, top_k=1)
    flat = comm.AlphaBeta("t", "nvlink", "dispatch", 5.0, {8: 1e9}, "fit")   # 5 us + bytes / 1 GB/s
    fits = {"dispatch": flat, "combine": flat}
    none = project_decode(cal, h, h, shape, fits, 8, 16, 1000, overlap="none")
    head = 128 * 2 / 1000
    compute = 2.0 * (head + (1 - head) * 2)
    disp = 5 + shape.dispatch_bytes(16) / 1e3                   # us: bytes / 1e9 B/s
    comb = 5 + shape.combine_bytes(16) / 1e3
    assert shape.dispatch_bytes(16) == 16 * (128 + 4) and shape.combine_bytes(16) == 16 * 256
    assert none.compute_ms == pytest.approx(compute)
    assert none.comm_ms == pytest.approx((disp + comb) * 8 / 1e3)
    assert none.step_ms == pytest.approx(compute + none.comm_ms)
    assert none.output_tok_s_per_rank == pytest.approx(16 / none.step_ms * 1e3)
    two = project_decode(cal, h, h, shape, fits, 8, 16, 1000)
    comm_two = 2 * (10 + (shape.dispatch_bytes(8) + shape.combine_bytes(8)) / 1e3) * 8 / 1e3
    assert two.comm_ms == pytest.approx(comm_two)
    assert two.step_ms == pytest.approx(max(compute, comm_two) + min(compute, comm_two) / 16)
    faster = project_decode(cal, h, hardware.profile("H200"), shape, fits, 8, 16, 1000, overlap="none")
    assert faster.compute_ms == pytest.approx(compute * h.memory_bytes_per_s / hardware.profile("H200").memory_bytes_per_s)
    assert "compute scaled from H100 to H200 by memory bandwidth" in faster.flags
    with pytest.raises(DeepInferError, match="overlap='tbo'"):
        project_decode(cal, h, h, shape, fits, 8, 16, 1000, overlap="tbo")
