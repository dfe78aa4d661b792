"""The compute term of the projection: one rank's decode step time, measured by `deepinfer-bench step --ep N --rank R`
(the one-GPU rank view, docs/parallel.md) at per-rank shapes and interpolated between them (docs/projection.md).

A row gives the GPU-busy time of rank R's step: the median of a graphed step, or the median x (1 - GPU idle fraction)
of an eager one (the launch gaps of an eager step are the host's, not the deployment's; flagged `eager`). Queries
interpolate linearly in batch, then in context, between measured points of the same EP size; a query outside the
measured batches or contexts takes the nearest measured edge and is flagged, and an EP size that was not measured is
refused (EP changes which experts and how many pairs a rank holds: it is measured, not interpolated)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deepinfer.errors import DeepInferError


@dataclass(frozen=True)
class Point:
    """One measured rank step."""
    ep: int
    batch: int
    context: int
    busy_ms: float
    expert_fraction: float        # routed-expert bytes / all bytes of the step's roofline
    busiest_over_own: float       # pairs of the busiest rank / this rank's pairs, summed over MoE layers (1 at EP 1)
    total_bytes: float            # the step's roofline bytes
    eager: bool


@dataclass(frozen=True)
class Lookup:
    busy_ms: float
    expert_fraction: float
    busiest_over_own: float
    total_bytes: float
    flags: tuple[str, ...]


def point_of(row: dict) -> Point:
    """A step row -> its calibration point."""
    ep = row.get("ep_size") or 1
    idle = row.get("gpu_idle_fraction")
    eager = not row["graphed"]
    if eager and idle is None:
        raise DeepInferError(f"row {row.get('key')}: an eager step without a GPU trace has no busy time; rerun "
                             f"with --trace-steps > 0")
    busy = row["step_ms_median"] * (1 - idle if eager else 1)
    ratio = 1.0
    layers = (row.get("expert_parallel") or {}).get("layers") or {}
    if layers:
        own = sum(v["pairs_per_rank"][row["ep_rank"]] for v in layers.values())
        ratio = sum(max(v["pairs_per_rank"]) for v in layers.values()) / max(own, 1)
    nbytes = row["bytes"]
    return Point(ep, row["batch"], row["context"], busy, nbytes["experts"] / nbytes["total"], ratio,
                 nbytes["total"], eager)


@dataclass
class Calibration:
    """The rank-step points of one run (one model spec, one device), with what identifies them in projected rows."""
    model: str
    hardware: str
    layers: int
    run: str
    started: str
    points: list[Point]

    @classmethod
    def from_run(cls, folder: str | Path) -> "Calibration":
        path = Path(folder) / "rows.jsonl"
        if not path.is_file():
            raise DeepInferError(f"no calibration rows at {path}: give a `deepinfer-bench step --ep ...` run folder")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("bench") == "step" and r.get("status", "ok") == "ok" and r.get("query_len") == 1]
        if not rows:
            raise DeepInferError(f"{path}: no finished decode step rows (query length 1)")
        first = rows[0]
        if len({(r["model"], r["hardware"]) for r in rows}) > 1:
            raise DeepInferError(f"{path}: rows of several models or devices; calibrate from one step run")
        return cls(first["model"], first["hardware"], first["layers"], first["run_id"], first["started"],
                   [point_of(r) for r in rows])

    def ep_sizes(self) -> list[int]:
        return sorted({p.ep for p in self.points})

    def lookup(self, ep: int, batch: float, context: float) -> Lookup:
        pts = [p for p in self.points if p.ep == ep]
        if not pts:
            raise DeepInferError(f"the calibration run {self.run} has no EP {ep} rank view (it has EP "
                                 f"{self.ep_sizes()}); run `deepinfer-bench step --ep {ep} ...` on this model")
        flags: list[str] = []
        contexts = sorted({p.context for p in pts})
        c_lo, c_hi, wc = _bracket(contexts, context, "context", flags)
        at = [self._at_context(pts, c, batch, flags) for c in (c_lo, c_hi)]
        mix = [(1 - wc) * a + wc * b for a, b in zip(at[0], at[1])]
        if any(p.eager for p in pts):
            flags.append("eager rows: busy time = median x (1 - GPU idle)")
        return Lookup(*mix, flags=tuple(dict.fromkeys(flags)))

    @staticmethod
    def _at_context(pts: list[Point], context: int, batch: float, flags: list[str]) -> tuple[float, ...]:
        row = {p.batch: p for p in pts if p.context == context}
        b_lo, b_hi, wb = _bracket(sorted(row), batch, "batch", flags)
        lo, hi = row[b_lo], row[b_hi]
        return tuple((1 - wb) * getattr(lo, f) + wb * getattr(hi, f)
                     for f in ("busy_ms", "expert_fraction", "busiest_over_own", "total_bytes"))


def _bracket(measured: list[int], x: float, what: str, flags: list[str]) -> tuple[int, int, float]:
    """(lower, upper, weight of upper) for linear interpolation; outside: the nearest edge, flagged."""
    if x <= measured[0] or x >= measured[-1]:
        edge = measured[0] if x <= measured[0] else measured[-1]
        if x != edge:
            flags.append(f"{what} {x:g} outside the measured {measured[0]}-{measured[-1]}: {what} {edge}'s value")
        return edge, edge, 0.0
    hi = next(m for m in measured if m >= x)
    lo = measured[measured.index(hi) - 1]
    return lo, hi, (x - lo) / (hi - lo)
