"""Benchmark metric math (vLLM `bench serve` definitions) and Pareto frontiers, on hand-made timelines."""

from __future__ import annotations

import math

import numpy as np
import pytest

from deepinfer.harness.frontier import frontiers, pareto_frontier
from deepinfer.harness.metrics import RequestTiming, compute_metrics, summarize, tokens_per_s_per_user

approx = pytest.approx


def three_requests() -> list[RequestTiming]:
    # A: TTFT 0.5, E2EL 1.1, TPOT 0.6/3 = 0.2, gaps 0.1 0.2 0.3
    # B: TTFT 0.2, E2EL 0.6, TPOT 0.4/1 = 0.4, gap 0.4
    # C: TTFT 1.0, E2EL 1.4, TPOT 0.4/4 = 0.1, gaps 0.1 x4
    return [
        RequestTiming(0.0, [0.5, 0.6, 0.8, 1.1], input_tokens=10, output_tokens=4),
        RequestTiming(1.0, [1.2, 1.6], input_tokens=20, output_tokens=2),
        RequestTiming(2.0, [3.0, 3.1, 3.2, 3.3, 3.4], input_tokens=30, output_tokens=5),
    ]


def test_three_requests_hand_computed():
    m = compute_metrics(three_requests(), duration=4.0, num_gpus=2)
    assert (m.completed, m.failed, m.total_input_tokens, m.total_output_tokens) == (3, 0, 60, 11)
    assert m.duration == 4.0
    assert m.request_throughput == approx(0.75)
    assert m.input_throughput == approx(15.0)
    assert m.output_throughput == approx(2.75)
    assert m.total_token_throughput == approx(17.75)

    # TTFT [0.5, 0.2, 1.0]; percentiles are linear between order statistics (rank = p/100 * (n-1)).
    assert m.ttft.count == 3
    assert m.ttft.mean == approx(1.7 / 3)
    assert m.ttft.median == approx(0.5)
    assert m.ttft.std == approx(math.sqrt(0.98) / 3)  # population std
    assert m.ttft.percentiles == {90.0: approx(0.9), 99.0: approx(0.99)}
    # E2EL [1.1, 0.6, 1.4]
    assert m.e2el.mean == approx(3.1 / 3)
    assert m.e2el.median == approx(1.1)
    assert m.e2el.percentiles == {90.0: approx(1.34), 99.0: approx(1.394)}
    # TPOT [0.2, 0.4, 0.1]
    assert m.tpot.count == 3
    assert m.tpot.mean == approx(0.7 / 3)
    assert m.tpot.median == approx(0.2)
    assert m.tpot.percentiles == {90.0: approx(0.36), 99.0: approx(0.396)}
    # ITL pooled: [0.1, 0.2, 0.3, 0.4, 0.1, 0.1, 0.1, 0.1]
    assert m.itl.count == 8
    assert m.itl.mean == approx(0.175)
    assert m.itl.median == approx(0.1)
    assert m.itl.percentiles == {90.0: approx(0.33), 99.0: approx(0.393)}
    # Interactivity = 1000 / median TPOT in ms = 1000 / 200.
    assert m.median_intvty == approx(5.0)
    assert tokens_per_s_per_user(0.2) == approx(5.0)

    row = m.to_row()
    assert row["median_tpot"] == approx(0.2)
    assert row["p99_tpot"] == approx(0.396)
    assert row["p90_ttft"] == approx(0.9)
    assert row["median_intvty"] == approx(5.0)
    assert row["p99_intvty"] == approx(1 / 0.396)
    assert row["mean_intvty"] == approx(3 / 0.7)
    assert "std_intvty" not in row
    assert row["tput_per_gpu"] == approx(17.75 / 2)
    assert row["output_tput_per_gpu"] == approx(2.75 / 2)
    assert row["input_tput_per_gpu"] == approx(15.0 / 2)

    vllm = m.to_vllm_dict()
    assert vllm["median_ttft_ms"] == approx(500.0)
    assert vllm["p99_itl_ms"] == approx(393.0)
    assert vllm["total_output_tokens"] == 11


def test_duration_inferred_from_span_and_no_gpu_count():
    m = compute_metrics(three_requests())
    assert m.duration == approx(3.4)  # earliest start 0.0 -> latest token 3.4
    assert m.output_throughput == approx(11 / 3.4)
    row = m.to_row()
    assert row["num_gpus"] is None and "tput_per_gpu" not in row
    with pytest.raises(ValueError, match="num_gpus"):
        m.per_gpu(m.output_throughput)


def test_matches_vllm_style_reference_on_random_timelines():
    """Cross-check against the vLLM client's own fields: ttft, latency and the per-chunk itl list."""
    rng = np.random.default_rng(0)
    reqs, ttfts, lats, tpots, itls = [], [], [], [], []
    for _ in range(50):
        start = float(rng.uniform(0, 10))
        n = int(rng.integers(1, 40))
        gaps = rng.uniform(0.01, 0.05, size=n - 1)
        ttft = float(rng.uniform(0.05, 2.0))
        times = start + ttft + np.concatenate([[0.0], np.cumsum(gaps)])
        reqs.append(RequestTiming(start, times.tolist(), int(rng.integers(1, 100)), n))
        ttfts.append(times[0] - start)
        lats.append(times[-1] - start)
        itls.extend(np.diff(times))
        if n > 1:
            tpots.append((lats[-1] - ttfts[-1]) / (n - 1))
    m = compute_metrics(reqs, duration=12.0, percentiles=(50, 90, 99, 99.9))
    for stat, ref in ((m.ttft, ttfts), (m.e2el, lats), (m.tpot, tpots), (m.itl, itls)):
        assert stat.mean == approx(np.mean(ref))
        assert stat.median == approx(np.median(ref))
        assert stat.std == approx(np.std(ref))
        for p in (50, 90, 99, 99.9):
            assert stat.percentiles[p] == approx(np.percentile(ref, p))
    assert "p99.9_ttft" in m.to_row() and "p50_itl_ms" in m.to_vllm_dict()


def test_single_token_request_has_no_tpot_or_itl():
    m = compute_metrics([RequestTiming(1.0, [1.3], input_tokens=8, output_tokens=1)], duration=1.0)
    assert m.completed == 1 and m.total_output_tokens == 1
    assert m.ttft.mean == approx(0.3) and m.e2el.mean == approx(0.3)
    assert m.tpot.count == 0 and math.isnan(m.tpot.median) and math.isnan(m.tpot.percentiles[99.0])
    assert m.itl.count == 0 and math.isnan(m.itl.mean)
    assert math.isnan(m.median_intvty)

    # Mixed in with a longer request, it counts for TTFT/E2EL/throughput only.
    m = compute_metrics(three_requests() + [RequestTiming(0.0, [0.3], 8, 1)], duration=4.0)
    assert m.ttft.count == 4 and m.e2el.count == 4
    assert m.tpot.count == 3 and m.tpot.median == approx(0.2)
    assert m.itl.count == 8
    assert m.total_output_tokens == 12 and m.total_input_tokens == 68


def test_tokens_in_one_chunk_give_one_itl_gap():
    # Two tokens arrive together (one streamed chunk, e.g. an accepted draft): vLLM logs one gap per chunk.
    m = compute_metrics([RequestTiming(0.0, [1.0, 1.0, 1.5], 5, 3)], duration=2.0)
    assert m.ttft.mean == approx(1.0)
    assert m.tpot.mean == approx(0.25)  # (1.5 - 1.0) / (3 - 1): TPOT counts tokens, not chunks
    assert m.itl.count == 1 and m.itl.mean == approx(0.5)


def test_failed_requests_counted_but_excluded():
    failed = [
        RequestTiming(0.0, [0.1], input_tokens=100, output_tokens=7, success=False),  # partial stream
        RequestTiming(0.5, [], input_tokens=50, output_tokens=0, success=False),
    ]
    m = compute_metrics(three_requests() + failed, duration=4.0)
    ref = compute_metrics(three_requests(), duration=4.0)
    assert (m.completed, m.failed) == (3, 2)
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 11)
    assert m.request_throughput == approx(0.75)
    assert m.ttft == ref.ttft and m.tpot == ref.tpot and m.itl == ref.itl and m.e2el == ref.e2el

    m = compute_metrics(failed)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 2, 0)
    assert m.duration == approx(0.5) and m.request_throughput == 0.0
    assert math.isnan(m.ttft.mean) and m.e2el.count == 0


@pytest.mark.parametrize(
    "req, message",
    [
        (RequestTiming(0.0, [0.5, 0.4], 1, 2), "go backwards at token 1"),
        (RequestTiming(1.0, [0.5, 1.5], 1, 2), "before the request started"),
        (RequestTiming(0.0, [0.5, 0.6], 1, 3), "output_tokens=3 but 2 token arrival times"),
        (RequestTiming(0.0, [], 1, 0), "at least one output token"),
        (RequestTiming(0.0, [0.5, float("nan")], 1, 2), "not finite"),
        (RequestTiming(float("inf"), [0.5], 1, 1), "start time"),
        (RequestTiming(0.0, [0.5], -1, 1), "input_tokens must be a non-negative int"),
        (RequestTiming(0.0, [0.5], 1, 1.0), "output_tokens must be a non-negative int"),
        (RequestTiming(0.0, [0.5, 0.4], 1, 2, success=False), "go backwards"),
    ],
)
def test_impossible_input_is_rejected(req, message):
    with pytest.raises(ValueError, match=message) as info:
        compute_metrics(three_requests() + [req], duration=4.0)
    assert "request 3" in str(info.value)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="no requests"):
        compute_metrics([])
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(three_requests(), duration=0.0)
    with pytest.raises(ValueError, match="num_gpus"):
        compute_metrics(three_requests(), num_gpus=0)
    with pytest.raises(ValueError, match="percentile"):
        compute_metrics(three_requests(), percentiles=(101,))
    with pytest.raises(ValueError, match="cannot infer a duration"):
        compute_metrics([RequestTiming(0.0, [0.0], 1, 1)])


def test_summarize_matches_numpy_default_percentile():
    s = summarize([4.0, 1.0, 3.0, 2.0], percentiles=(25, 90))
    assert (s.count, s.mean, s.median) == (4, 2.5, 2.5)
    assert s.percentiles == {25.0: approx(1.75), 90.0: approx(3.7)}


# ---- frontier ----


def pt(name, x, y, **keys):
    return {"name": name, "x": x, "y": y, **keys}


POINTS = [
    pt("A", 1.0, 10.0),
    pt("B", 2.0, 20.0),
    pt("C", 2.0, 15.0),  # same x as B, lower y
    pt("D", 3.0, 18.0),  # worse x and y than B
    pt("E", 4.0, 30.0),
    pt("F", 4.0, 30.0),  # exact duplicate of E: the first one (E) stays
    pt("G", 0.5, 5.0),
    pt("H", 5.0, 1.0),
    pt("I", 6.0, 30.0),  # same y as E at worse (lower-better) x
]


def names(rows):
    return [r["name"] for r in rows]


def test_frontier_lower_x_higher_y():
    # e.g. tok/s/GPU vs median E2EL: minimise latency, maximise throughput
    assert names(pareto_frontier(POINTS, "x", "y", x_better="lower")) == ["G", "A", "B", "E"]


def test_frontier_higher_x_higher_y():
    # e.g. output tok/s/GPU vs tok/s/user: maximise both
    assert names(pareto_frontier(POINTS, "x", "y", x_better="higher")) == ["I"]
    pts = POINTS + [pt("J", 7.0, 2.0)]
    assert names(pareto_frontier(pts, "x", "y", x_better="higher")) == ["I", "J"]


def test_frontier_lower_y():
    # maximise interactivity, minimise cost
    assert names(pareto_frontier(POINTS, "x", "y", x_better="higher", y_better="lower")) == ["H", "I"]


def test_frontier_is_deterministic_on_ties_and_order():
    rng = np.random.default_rng(1)
    expected = ["G", "A", "B", "E"]
    for _ in range(5):
        shuffled = [POINTS[i] for i in rng.permutation(len(POINTS))]
        got = pareto_frontier(shuffled, "x", "y")
        assert names(got) in (expected, ["G", "A", "B", "F"])
        first_dup = next(r for r in shuffled if r["name"] in "EF")
        assert got[-1] is first_dup  # the first of two identical points is the one kept


def test_frontier_skips_missing_values_and_rejects_bad_input():
    rows = POINTS + [pt("N", float("nan"), 100.0), pt("M", 0.1, None)]
    assert names(pareto_frontier(rows, "x", "y")) == ["G", "A", "B", "E"]
    assert pareto_frontier([], "x", "y") == []
    with pytest.raises(ValueError, match="no 'z' field"):
        pareto_frontier(POINTS, "x", "z")
    with pytest.raises(ValueError, match="not a number"):
        pareto_frontier([pt("S", "fast", 1.0)], "x", "y")
    with pytest.raises(ValueError, match="x_better"):
        pareto_frontier(POINTS, "x", "y", x_better="left")


def test_frontiers_grouped():
    rows = [
        pt("h1", 1.0, 10.0, hardware="h200", engine="deepinfer", spec_mode="mtp1", is_projected=False),
        pt("h2", 2.0, 5.0, hardware="h200", engine="deepinfer", spec_mode="mtp1", is_projected=False),
        pt("h3", 3.0, 20.0, hardware="h200", engine="deepinfer", spec_mode="mtp1", is_projected=False),
        pt("p1", 1.0, 50.0, hardware="h200", engine="deepinfer", spec_mode="mtp1", is_projected=True),
        pt("b1", 2.0, 7.0, hardware="b200", engine="deepinfer", spec_mode="none", is_projected=False),
        pt("b2", 1.0, 7.0, hardware="b200", engine="deepinfer", spec_mode="none", is_projected=False),
    ]
    keys = ("hardware", "engine", "spec_mode", "is_projected")
    out = frontiers(rows, keys, "x", "y", x_better="higher")
    assert list(out) == [
        ("h200", "deepinfer", "mtp1", False),
        ("h200", "deepinfer", "mtp1", True),
        ("b200", "deepinfer", "none", False),
    ]
    assert names(out[("h200", "deepinfer", "mtp1", False)]) == ["h3"]
    assert names(out[("h200", "deepinfer", "mtp1", True)]) == ["p1"]  # projected points never mix with measured
    assert names(out[("b200", "deepinfer", "none", False)]) == ["b1"]

    out = frontiers(rows, ("hardware",), "x", "y", x_better="lower")
    assert names(out[("h200",)]) == ["p1"]
    assert names(out[("b200",)]) == ["b2"]
    # a missing group key reads as None
    assert list(frontiers([pt("z", 1.0, 1.0)], ("hardware",), "x", "y")) == [(None,)]
