"""Serving metrics from per-request timelines, defined as `vllm bench serve` defines them
(`vllm/benchmarks/serve.py`, `calculate_metrics`), stored InferenceX-style (seconds, `*_intvty` twins).

Per successful request (times in seconds, client clock):
  TTFT = first token arrival - start
  E2EL = last token arrival - start
  TPOT = (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token
  ITL  = every gap between consecutive arrivals, pooled over all requests. As in vLLM, whose client
         records one gap per streamed chunk, tokens that arrive at the same instant (one chunk,
         e.g. several accepted draft tokens) form one arrival: zero gaps are not pooled.
Stats per metric: mean, median, population std (`np.std`), and `np.percentile` (linear interpolation).
Throughputs divide successful requests/tokens by the run's wall duration. Failed requests are counted
in `failed` and nowhere else (vLLM counts neither their input nor their output tokens).

Interactivity (InferenceX's decode x-axis) is tokens/s/user = 1000 / TPOT in ms = 1 / TPOT in s; each
TPOT statistic has an `intvty` twin (so p99 interactivity = 1 / p99 TPOT, the slow tail).

Where vLLM reports 0 for a metric with no samples (no streaming, only 1-token outputs), we report NaN,
so an empty sample never plots as a perfect latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)


@dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it. `token_times` holds one arrival time per output token (the
    first is the first token), on the same clock as `start`. A failed request may carry partial times;
    only its success flag is used."""

    start: float
    token_times: Sequence[float]
    input_tokens: int
    output_tokens: int
    success: bool = True


@dataclass(frozen=True)
class Stat:
    """Summary of one latency metric in seconds; `count` = number of samples (NaN stats when 0)."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchMetrics:
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    duration: float
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    num_gpus: int | None
    ttft: Stat
    tpot: Stat
    itl: Stat
    e2el: Stat

    @property
    def median_intvty(self) -> float:
        """Tokens/s/user at the median TPOT (InferenceX `median_intvty`)."""
        return _interactivity(self.tpot.median)

    def per_gpu(self, throughput: float) -> float:
        if self.num_gpus is None:
            raise ValueError("per-GPU throughput needs num_gpus; pass num_gpus to compute_metrics")
        return throughput / self.num_gpus

    def to_row(self) -> dict[str, float | int | None]:
        """Flat dict, InferenceX naming: latencies in seconds without a unit suffix
        (`mean_ttft`, `median_tpot`, `p99_itl`, `std_e2el`, ...), `*_intvty` twins of every TPOT stat,
        and `tput_per_gpu` / `output_tput_per_gpu` / `input_tput_per_gpu` when num_gpus is known."""
        row: dict[str, float | int | None] = {
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "duration": self.duration,
            "request_throughput": self.request_throughput,
            "input_throughput": self.input_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "num_gpus": self.num_gpus,
        }
        if self.num_gpus is not None:
            row["tput_per_gpu"] = self.per_gpu(self.total_token_throughput)
            row["output_tput_per_gpu"] = self.per_gpu(self.output_throughput)
            row["input_tput_per_gpu"] = self.per_gpu(self.input_throughput)
        for name in LATENCY_METRICS:
            stat: Stat = getattr(self, name)
            row[f"mean_{name}"] = stat.mean
            row[f"median_{name}"] = stat.median
            row[f"std_{name}"] = stat.std
            for p, value in stat.percentiles.items():
                row[f"p{_pct_label(p)}_{name}"] = value
        for key in [k for k in row if k.endswith("_tpot") and not k.startswith("std_")]:
            row[key[: -len("tpot")] + "intvty"] = _interactivity(row[key])  # type: ignore[arg-type]
        return row

    def to_vllm_dict(self) -> dict[str, float | int]:
        """The metric keys of a `vllm bench serve --save-result` JSON (latencies in ms)."""
        out: dict[str, float | int] = {
            "duration": self.duration,
            "completed": self.completed,
            "failed": self.failed,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in LATENCY_METRICS:
            stat: Stat = getattr(self, name)
            out[f"mean_{name}_ms"] = stat.mean * 1000
            out[f"median_{name}_ms"] = stat.median * 1000
            out[f"std_{name}_ms"] = stat.std * 1000
            for p, value in stat.percentiles.items():
                out[f"p{_pct_label(p)}_{name}_ms"] = value * 1000
        return out


def compute_metrics(
    requests: Sequence[RequestTiming],
    duration: float | None = None,
    num_gpus: int | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> BenchMetrics:
    """Metrics of one benchmark run.

    `duration`: the run's wall time in seconds. vLLM uses the wall clock from just before the first
    request is sent until all have returned; pass that when you have it. If None, it is the span from
    the earliest start to the latest token arrival over all requests (failed ones included)."""
    if not requests:
        raise ValueError("compute_metrics: no requests given")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"compute_metrics: percentile {p} is outside [0, 100]")
    if num_gpus is not None and (isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1):
        raise ValueError(f"compute_metrics: num_gpus must be a positive int, got {num_gpus!r}")
    for i, req in enumerate(requests):
        _check_request(i, req)

    done = [r for r in requests if r.success]
    ttfts = [r.token_times[0] - r.start for r in done]
    e2els = [r.token_times[-1] - r.start for r in done]
    tpots = [
        (e2el - ttft) / (r.output_tokens - 1) for r, ttft, e2el in zip(done, ttfts, e2els) if r.output_tokens > 1
    ]
    itls = [gap for r in done for gap in chunk_gaps(r)]

    if duration is None:
        first = min(r.start for r in requests)
        last = max(r.token_times[-1] if len(r.token_times) else r.start for r in requests)
        duration = last - first
        if duration <= 0:
            raise ValueError(
                "compute_metrics: cannot infer a duration (all requests start and end at one instant); pass duration="
            )
    elif not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"compute_metrics: duration must be a positive finite number of seconds, got {duration!r}")

    total_in = sum(r.input_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    return BenchMetrics(
        completed=len(done),
        failed=len(requests) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        duration=float(duration),
        request_throughput=len(done) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        num_gpus=num_gpus,
        ttft=summarize(ttfts, percentiles),
        tpot=summarize(tpots, percentiles),
        itl=summarize(itls, percentiles),
        e2el=summarize(e2els, percentiles),
    )


def summarize(samples: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Stat:
    """mean / median / population std / linear percentiles, as numpy computes them for vLLM."""
    if len(samples) == 0:
        nan = float("nan")
        return Stat(0, nan, nan, nan, {float(p): nan for p in percentiles})
    a = np.asarray(samples, dtype=np.float64)
    return Stat(
        count=len(a),
        mean=float(np.mean(a)),
        median=float(np.median(a)),
        std=float(np.std(a)),
        percentiles={float(p): float(np.percentile(a, p)) for p in percentiles},
    )


def tokens_per_s_per_user(tpot_s: float) -> float:
    """Interactivity: 1000 / TPOT_ms (= 1 / TPOT_s); NaN when TPOT is NaN, inf when it is 0."""
    return _interactivity(tpot_s)


def chunk_gaps(req: RequestTiming) -> list[float]:
    """Inter-token latencies of one request: gaps between successive arrivals, tokens that arrived together
    counting as one chunk (as a streaming client sees them)."""
    gaps = np.diff(np.asarray(req.token_times, dtype=np.float64))
    return gaps[gaps > 0].tolist()


def _interactivity(tpot_s: float | None) -> float:
    if tpot_s is None or math.isnan(tpot_s):
        return float("nan")
    if tpot_s == 0:
        return float("inf")
    return 1.0 / tpot_s


def _pct_label(p: float) -> str:
    """99.0 -> '99', 99.9 -> '99.9' (vLLM's key style)."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _check_request(i: int, req: RequestTiming) -> None:
    where = f"request {i}"
    if not math.isfinite(req.start):
        raise ValueError(f"{where}: start time {req.start!r} is not finite")
    for name in ("input_tokens", "output_tokens"):
        value = getattr(req, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{where}: {name} must be a non-negative int, got {value!r}")
    times = req.token_times
    for j, t in enumerate(times):
        if not math.isfinite(t):
            raise ValueError(f"{where}: token {j} arrival time {t!r} is not finite")
    if len(times) and times[0] < req.start:
        raise ValueError(f"{where}: first token arrives at {times[0]!r}, before the request started at {req.start!r}")
    for j in range(1, len(times)):
        if times[j] < times[j - 1]:
            raise ValueError(
                f"{where}: token arrival times go backwards at token {j} ({times[j - 1]!r} -> {times[j]!r})"
            )
    if not req.success:
        return
    if req.output_tokens == 0 or len(times) == 0:
        raise ValueError(f"{where}: a successful request needs at least one output token and its arrival time")
    if len(times) != req.output_tokens:
        raise ValueError(
            f"{where}: output_tokens={req.output_tokens} but {len(times)} token arrival times were given "
            "(need one time per output token)"
        )
