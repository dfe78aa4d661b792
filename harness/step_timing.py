"""How the step bench times a step and how idle the GPU is between its kernels (docs/bench.md).

  timing    CUDA events around each run() on a GPU (graph replay where the engine captured one), perf_counter on
            the CPU;
  idle      a torch.profiler trace over consecutive runs: 1 - (union of GPU kernel / memcpy / memset intervals) /
            (first start .. last end); None on the CPU."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

BUSY_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(run, device: torch.device, iters: int) -> dict:
    """Per-step ms of `iters` back-to-back run() calls: CUDA events around each (graph replays queue ahead,
    so events measure device time plus any launch gaps inside a step), perf_counter on CPU."""
    if device.type == "cuda":
        sync(device)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in pairs:
            a.record()
            run()
            b.record()
        sync(device)
        ms = [a.elapsed_time(b) for a, b in pairs]
        span = pairs[0][0].elapsed_time(pairs[-1][1])
    else:
        ms = []
        t_start = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            ms.append(1e3 * (time.perf_counter() - t0))
        span = 1e3 * (time.perf_counter() - t_start)
    return {"step_ms_mean": statistics.fmean(ms), "step_ms_median": statistics.median(ms),
            "step_ms_p90": _percentile(ms, 0.9), "step_ms_min": min(ms), "step_ms_max": max(ms),
            "step_ms_span_mean": span / iters, "step_ms_samples": ms}


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the union of [start, end) intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (cur_b - cur_a if cur_b is not None else 0.0)


TOP_KERNELS = 25         # GPU activities listed per traced point by time (gpu_trace.top_kernels)
TOP_LAUNCHES = 30        # ... and by calls (gpu_trace.top_launches: where the launch count goes)


def idle_from_trace(events: list[dict]) -> dict | None:
    """Chrome-trace events -> GPU idle between the first kernel start and the last kernel end (None when the
    trace holds no GPU activity)."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
             if e.get("ph") == "X" and str(e.get("cat", "")).lower() in BUSY_CATEGORIES]
    if not spans:
        return None
    start, end = min(a for a, _ in spans), max(b for _, b in spans)
    busy = busy_union(spans)
    span = end - start
    return {"idle_fraction": 1.0 - busy / span if span > 0 else 0.0, "busy_us": busy, "span_us": span,
            "kernels": len(spans)}


def gpu_idle(run, device: torch.device, steps: int) -> dict | None:
    """Profile `steps` consecutive run() calls (CUDA activity only, so tracing adds no host work to them)."""
    if device.type != "cuda":
        return None
    import warnings

    from torch.profiler import ProfilerActivity, profile
    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # "Profiler clears events at the end of each cycle": one cycle here
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run()
            sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    out = idle_from_trace(events)
    if out is not None:
        out["idle_ms_per_step"] = (out["span_us"] - out["busy_us"]) / 1e3 / steps
        out["gpu_ops_per_step"] = out["kernels"] / steps          # kernels + memcpy / memset: the launches
        out["top_kernels"] = top_kernels(events, steps)
        out["top_launches"] = top_kernels(events, steps, TOP_LAUNCHES, by="calls")
    return out


def top_kernels(events: list[dict], steps: int, top: int = TOP_KERNELS, by: str = "us") -> list[dict]:
    """Where a step's GPU time (by="us") or its launches (by="calls") go: the `top` GPU activities (grouped by full
    name), per step, each {name (cut to 120 characters), us (per step), calls (per step), share (of all GPU activity
    time)}; ties in calls go to the longer total time."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")).lower() in BUSY_CATEGORIES:
            acc = by_name.setdefault(str(e.get("name", "?")), [0.0, 0])
            acc[0] += float(e.get("dur", 0))
            acc[1] += 1
    total = sum(us for us, _ in by_name.values()) or 1.0
    if by not in ("us", "calls"):
        raise ValueError(f"top_kernels ranks by 'us' or 'calls', got {by!r}")
    key = (lambda kv: -kv[1][0]) if by == "us" else (lambda kv: (-kv[1][1], -kv[1][0]))
    ranked = sorted(by_name.items(), key=key)[:top]
    return [{"name": name[:120], "us": us / steps, "calls": calls / steps, "share": us / total}
            for name, (us, calls) in ranked]

