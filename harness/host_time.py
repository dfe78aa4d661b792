"""A point's host-time fields: where the engine loop's wall time went, per launched step (EngineStats' host_* and
device_wait_s over the timed requests, engine/stats.py). With asynchronous scheduling the host plans, launches and
applies while the device runs a step; `device_wait_ms` is the part of a step the host spent waiting for the device.
Near zero, the loop is host-bound: the host's plan + launch + apply is the step time the user sees, not the
device's (end-to-end TPOT against the graph step). On a CPU device the forward runs inside launch."""

from __future__ import annotations

FIELDS = ("host_plan_ms", "host_launch_ms", "host_apply_ms", "device_wait_ms", "host_ms")


def host_fields(stats) -> dict:
    """Milliseconds per launched step (None for a point that launched none)."""
    steps = stats.steps
    if not steps:
        return dict.fromkeys(FIELDS)
    per = lambda s: round(s * 1e3 / steps, 4)   # noqa: E731
    out = {"host_plan_ms": per(stats.host_plan_s), "host_launch_ms": per(stats.host_launch_s),
           "host_apply_ms": per(stats.host_apply_s), "device_wait_ms": per(stats.device_wait_s)}
    out["host_ms"] = per(stats.host_plan_s + stats.host_launch_s + stats.host_apply_s)
    return out
