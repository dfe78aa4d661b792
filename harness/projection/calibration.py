"""The compute term of the projection: one rank's decode step time, measured by `deepinfer-bench step --ep N --rank R`
(the one-GPU rank view, docs/parallel.md) at per-rank shapes and interpolated between them (docs/projection.md).

A row gives the GPU-busy time of rank R's step: the median of a graphed step, or the median x (1 - GPU idle fraction)
of an eager one (the launch gaps of an eager step are the host's, not the deployment's; flagged `eager`). Queries
interpolate in batch, then linearly in context, between measured points of the same EP size. In batch the time is
linear in the step's roofline bytes, whose expert part grows with the share of the rank's experts a batch touches
under balanced routing (1 - (1 - top_k / experts) ^ pairs: it saturates, so a line in batch would miss between
points far apart). Outside the measured points, and flagged in the result: a batch above the largest continues the
line through the two largest (below the smallest: the smallest's value); a context outside the measured ones scales the nearest one's time by the step's
roofline bytes with the state bytes in proportion to context (decode is memory-bound). An EP size that was not
measured is refused (EP changes which experts and how many pairs a rank holds: it is measured, not interpolated)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
    state_bytes: float = 0.0      # the roofline bytes of the rows' state (grows with context)
    pick: float = 0.0             # the chance one routed pair lands on a given expert of this rank (top_k / experts)
    pairs_per_seq: float = 0.0    # routed pairs this rank's experts receive per sequence of its batch (per layer)

    def touched(self, batch: float) -> float:
        """The expected share of this rank's experts a step at `batch` touches under balanced routing."""
        return 1 - (1 - self.pick) ** (self.pairs_per_seq * batch) if self.pick else 1.0

    def bytes_at(self, batch: float) -> float:
        """This point's roofline bytes moved to `batch`: the experts' by the share touched, the state's by rows."""
        experts = self.expert_fraction * self.total_bytes
        dense = self.total_bytes - experts - self.state_bytes
        return dense + experts * self.touched(batch) / self.touched(self.batch) + self.state_bytes * batch / self.batch


@dataclass(frozen=True)
class Lookup:
    busy_ms: float
    expert_fraction: float
    busiest_over_own: float
    total_bytes: float
    flags: tuple[str, ...]


def run_settings(row: dict) -> dict:
    """The numerics a step row ran with, as a sweep names them."""
    return {k: row[k] for k in ("expert_storage", "precision") if row.get(k) is not None}


def busy_ms(row: dict) -> float:
    """A step row's GPU-busy time: the median of a graphed step; median x (1 - GPU idle fraction) of an eager one
    with a trace (the launch gaps of an eager step are the host's); the median where there is no trace."""
    idle = row.get("gpu_idle_fraction")
    return row["step_ms_median"] * (1 - idle if idle is not None and not row.get("graphed") else 1)


def point_of(row: dict) -> Point:
    """A step row -> its calibration point."""
    ep = row.get("ep_size") or 1
    idle = row.get("gpu_idle_fraction")
    eager = not row["graphed"]
    if eager and idle is None:
        raise DeepInferError(f"row {row.get('key')}: an eager step without a GPU trace has no busy time; rerun "
                             f"with --trace-steps > 0")
    busy = busy_ms(row)
    ratio = 1.0
    layers = (row.get("expert_parallel") or {}).get("layers") or {}
    if layers:
        own = sum(v["pairs_per_rank"][row["ep_rank"]] for v in layers.values())
        ratio = sum(max(v["pairs_per_rank"]) for v in layers.values()) / max(own, 1)
    nbytes = row["bytes"]
    traffic = list(((row.get("expert_traffic") or {}).get("layers") or {}).values())
    pick = pairs = 0.0
    if traffic:              # rank views record the rank's own experts and the pairs they received (top_k 1 each)
        pick = sum(t["top_k"] / t["experts"] for t in traffic) / len(traffic)
        pairs = sum(t["rows"] for t in traffic) / len(traffic) / row["batch"]
    return Point(ep, row["batch"], row["context"], busy, nbytes["experts"] / nbytes["total"], ratio,
                 nbytes["total"], eager, nbytes.get("state", 0.0), pick, pairs)


@dataclass
class Calibration:
    """The rank-step points of one run (one model spec, one device), with what identifies them in projected rows."""
    model: str
    hardware: str
    layers: int
    run: str
    started: str
    points: list[Point]
    weight_bytes: dict | None = None    # at the calibrated depth: "dense" (every rank's), "experts" (all routed),
                                        # "state_per_token" (one sequence's state per position); None: not recorded
    settings: dict = field(default_factory=dict)    # the numerics it ran: expert_storage, precision

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
        weights = None
        plain = [r for r in rows if (r.get("ep_size") or 1) == 1 and "expert_bytes_all" in r and r["context"]]
        if plain:                # an EP 1 row holds the whole model: what a deployment's ranks divide
            r = plain[0]
            weights = {"dense": r["bytes"]["dense_weights"], "experts": r["expert_bytes_all"],
                       "state_per_token": r["bytes"].get("state", 0) / (r["batch"] * r["context"])}
        return cls(first["model"], first["hardware"], first["layers"], Path(folder).name, first["started"],
                   [point_of(r) for r in rows], weights, run_settings(first))

    def ep_sizes(self) -> list[int]:
        return sorted({p.ep for p in self.points})

    def lookup(self, ep: int, batch: float, context: float) -> Lookup:
        pts = [p for p in self.points if p.ep == ep]
        if not pts:
            raise DeepInferError(f"the calibration run {self.run} has no EP {ep} rank view (it has EP "
                                 f"{self.ep_sizes()}); run `deepinfer-bench step --ep {ep} ...` on this model")
        flags: list[str] = []
        contexts = sorted({p.context for p in pts})
        c_lo, c_hi, wc = _bracket(contexts, context, "context", [], extend=False)     # flagged below when outside
        at = [self._at_context(pts, c, batch, flags) for c in (c_lo, c_hi)]
        busy, fraction, busiest, total, state = [(1 - wc) * a + wc * b for a, b in zip(at[0], at[1])]
        if c_lo == c_hi and context != c_lo:
            # memory-bound: the time follows the bytes, whose state part grows with context
            scale = (total + state * (context / c_lo - 1)) / total
            busy, total = busy * scale, total * scale
            flags.append(f"context {context:g} outside the measured {contexts[0]}-{contexts[-1]}: context {c_lo}'s "
                         f"time x its roofline bytes at {context:g} ({scale:.3g}x)")
        if any(p.eager for p in pts):
            flags.append("eager rows: busy time = median x (1 - GPU idle)")
        return Lookup(busy, fraction, busiest, total, flags=tuple(dict.fromkeys(flags)))

    @staticmethod
    def _at_context(pts: list[Point], context: int, batch: float, flags: list[str]) -> tuple[float, ...]:
        """(busy_ms, expert_fraction, busiest_over_own, total_bytes, state_bytes) at `context`, over batch: linear in
        the step's roofline bytes between the measured batches around it (decode is memory-bound, and the bytes
        of the experts grow with the share a batch touches, which saturates), the bytes taken from the upper point
        moved to each batch."""
        row = {p.batch: p for p in pts if p.context == context}
        b_lo, b_hi, wb = _bracket(sorted(row), batch, "batch", flags, extend=True)
        lo, hi = row[b_lo], row[b_hi]
        if b_lo != b_hi:
            at = [hi.bytes_at(b) for b in (b_lo, batch, b_hi)]
            wb = (at[1] - at[0]) / (at[2] - at[0]) if at[2] != at[0] else wb
        line = [(1 - wb) * getattr(lo, f) + wb * getattr(hi, f) for f in ("busy_ms", "total_bytes", "state_bytes")]
        # shares stay the largest batch's where the line is continued past it
        ws = min(wb, 1.0)
        shares = [(1 - ws) * getattr(lo, f) + ws * getattr(hi, f) for f in ("expert_fraction", "busiest_over_own")]
        return line[0], shares[0], shares[1], line[1], line[2]


def _bracket(measured: list[int], x: float, what: str, flags: list[str], extend: bool) -> tuple[int, int, float]:
    """(lower, upper, weight of upper) for linear interpolation. Above the largest, with `extend` and two points:
    the two largest and a weight above 1 (the line continued); otherwise outside: the nearest edge. Both flagged."""
    if extend and x > measured[-1] and len(measured) > 1:
        lo, hi = measured[-2], measured[-1]
        flags.append(f"{what} {x:g} above the measured {measured[0]}-{hi}: the line through {what} {lo} and {hi}")
        return lo, hi, (x - lo) / (hi - lo)
    if x <= measured[0] or x >= measured[-1]:
        edge = measured[0] if x <= measured[0] else measured[-1]
        if x != edge:
            flags.append(f"{what} {x:g} outside the measured {measured[0]}-{measured[-1]}: {what} {edge}'s value")
        return edge, edge, 0.0
    hi = next(m for m in measured if m >= x)
    lo = measured[measured.index(hi) - 1]
    return lo, hi, (x - lo) / (hi - lo)
