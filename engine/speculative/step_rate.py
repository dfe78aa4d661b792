"""Step rates for the verify schedules: seconds per engine step as a function of the step's batch tokens
(StepRate), and of the step's shape (StepRateTable: one StepRate per profiled context and segment count,
interpolated between them). A verify row's cost grows with its context (the sliding window, compressed entries,
the indexer's keys), and a step's with its segment count at equal tokens (draft-block rows, verifications)."""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Mapping, Sequence

from ..errors import DeepInferError


class StepRate:
    """Target steps per second as a function of the batch's token count, from a profiled table of seconds per step.

    Seconds are interpolated linearly between profiled points, flat (the first point's time) below the first point,
    and extrapolated from the last two points above the last one, never below the last point's time."""

    def __init__(self, tokens: Sequence[int], seconds: Sequence[float]):
        tokens, seconds = list(tokens), list(seconds)
        if not tokens or len(tokens) != len(seconds):
            raise DeepInferError(f"step-rate table needs as many seconds as token counts (>= 1 point); got "
                                 f"{len(tokens)} token counts and {len(seconds)} seconds")
        if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 1 for t in tokens):
            raise DeepInferError(f"step-rate token counts {tokens!r} must be integers >= 1")
        if any(b <= a for a, b in zip(tokens, tokens[1:])):
            raise DeepInferError(f"step-rate token counts {tokens!r} must be strictly increasing")
        if any(isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s <= 0
               for s in seconds):
            raise DeepInferError(f"step-rate seconds {seconds!r} must be finite numbers > 0")
        self.tokens = [int(t) for t in tokens]
        self.times = [float(s) for s in seconds]

    @classmethod
    def from_dict(cls, d: dict[int, float]) -> StepRate:
        """A table from {batch tokens: seconds per step}, in any key order."""
        if not isinstance(d, dict):
            raise DeepInferError(f"step-rate table must be a dict of batch tokens to seconds; got {type(d).__name__}")
        items = sorted(d.items())
        return cls([t for t, _ in items], [s for _, s in items])

    @classmethod
    def linear(cls, fixed_s: float, per_token_s: float, max_tokens: int) -> StepRate:
        """A synthetic table, seconds(b) = fixed_s + per_token_s * b, profiled at 1, 2, 4, .. and max_tokens."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral) or max_tokens < 1:
            raise DeepInferError(f"step-rate max_tokens={max_tokens!r} must be an integer >= 1")
        if not (fixed_s >= 0 and per_token_s >= 0):
            raise DeepInferError(f"step-rate fixed_s={fixed_s!r} and per_token_s={per_token_s!r} must be >= 0")
        points = sorted({1 << k for k in range(int(max_tokens).bit_length()) if 1 << k <= max_tokens}
                        | {int(max_tokens)})
        return cls(points, [fixed_s + per_token_s * b for b in points])

    def with_offset(self, seconds: float) -> StepRate:
        """The same table with `seconds` more at every point (a per-step cost the profile did not see)."""
        return StepRate(self.tokens, [t + seconds for t in self.times])

    def to_dict(self) -> dict[int, float]:
        """The profiled points as {batch tokens: seconds per step}."""
        return dict(zip(self.tokens, self.times))

    def seconds(self, b: int) -> float:
        """Seconds per step at b batch tokens (see the class docstring for the rule off the table)."""
        ts, ss = self.tokens, self.times
        if b <= ts[0]:
            return ss[0]
        i = bisect.bisect_left(ts, b)
        if i < len(ts):
            if ts[i] == b:
                return ss[i]
            t0, t1, s0, s1 = ts[i - 1], ts[i], ss[i - 1], ss[i]
            return s0 + (s1 - s0) * (b - t0) / (t1 - t0)
        if len(ts) == 1:
            return ss[-1]
        t0, t1, s0, s1 = ts[-2], ts[-1], ss[-2], ss[-1]
        return max(s1, s1 + (s1 - s0) * (b - t1) / (t1 - t0))

    def __call__(self, b: int) -> float:
        """Steps per second at b batch tokens: 1 / seconds(b)."""
        return 1.0 / self.seconds(b)

    def __repr__(self) -> str:
        return f"StepRate.from_dict({self.to_dict()!r})"


class StepRateTable:
    """Seconds per verify step by (context, segments, batch tokens): a StepRate per profiled (context, R), where R
    is the step's segment count (requests verifying: each feeds its last token and its verified drafts) and the
    table's tokens B run from R to (drafts + 1) x R (the row counts the verify graphs run at, runner/rate_profile.py).
    A step's cost is not a function of B alone: R segments cost R draft-block rows and R verifications, whatever
    their lengths.

    at(context, R) gives the StepRate a step of R requests at that context is scheduled by: at each profiled
    context, linear in R between the two profiled segment counts around it (at equal l; clamped to the profiled
    range), then linear in the context between the two profiled contexts around it (below the first: the first;
    above the last: extrapolated from the last two, attention work growing linearly with context, never below the
    last). A table from one plain StepRate (`flat`) gives that StepRate at every context and R."""

    def __init__(self, points: Mapping[int, Mapping[int, StepRate]] | None = None, flat: StepRate | None = None):
        if (points is None) == (flat is None):
            raise DeepInferError("internal: a step-rate table is profiled points or one flat StepRate")
        self.flat = flat
        self.points: dict[int, dict[int, StepRate]] = {}
        if points is not None:
            if not points or any(not row for row in points.values()):
                raise DeepInferError("a step-rate table needs at least one profiled context and segment count")
            for c, row in points.items():
                if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo
                       for v, lo in [(c, 0), *((r, 1) for r in row)]):
                    raise DeepInferError(f"step-rate contexts {sorted(points)!r} must be integers >= 0 and segment "
                                         f"counts {sorted(row)!r} integers >= 1")
                self.points[int(c)] = {int(r): row[r] for r in sorted(row)}
        self.contexts = sorted(self.points)
        self._cache: dict[tuple[int, int], StepRate] = {}

    @classmethod
    def from_dict(cls, d: Mapping) -> StepRateTable:
        """{context: {segments: {tokens: seconds}}} (JSON's string keys accepted), or a plain {tokens: seconds}
        (one table for every context and segment count)."""
        if d and all(isinstance(v, Mapping) for v in d.values()):
            return cls({int(c): {int(r): StepRate.from_dict({int(t): s for t, s in row.items()})
                                 for r, row in by_r.items()} for c, by_r in d.items()})
        return cls(flat=StepRate.from_dict(dict(d)))

    def to_dict(self) -> dict:
        if self.flat is not None:
            return self.flat.to_dict()
        return {c: {r: t.to_dict() for r, t in row.items()} for c, row in self.points.items()}

    def at(self, context: float, segments: int) -> StepRate:
        """The StepRate of a step of `segments` verifying requests whose state holds `context` positions on
        average (rounded to an integer); see the class docstring."""
        if self.flat is not None:
            return self.flat
        key = (max(int(round(context)), 0), max(int(segments), 1))
        hit = self._cache.get(key)
        if hit is None:
            hit = _blend([(c, _at_segments(self.points[c], key[1])) for c in self.contexts], key[0])
            if len(self._cache) < 1 << 14:
                self._cache[key] = hit
        return hit


def _at_segments(row: dict[int, StepRate], r: int) -> StepRate:
    """The StepRate of r segments from one context's tables (keyed by segment count), at equal rows per segment."""
    counts = list(row)
    r = min(max(r, counts[0]), counts[-1])
    if r in row:
        return row[r]
    i = bisect.bisect_left(counts, r)
    r0, r1 = counts[i - 1], counts[i]
    w = (r - r0) / (r1 - r0)
    t0, t1 = row[r0], row[r1]
    per_row = sorted({b / r0 for b in t0.tokens} | {b / r1 for b in t1.tokens})
    tokens, seconds = [], []
    for l in per_row:
        b = max(int(round(l * r)), 1)
        if tokens and b <= tokens[-1]:
            continue
        tokens.append(b)
        seconds.append(t0.seconds(round(l * r0)) + w * (t1.seconds(round(l * r1)) - t0.seconds(round(l * r0))))
    return StepRate(tokens, seconds)


def _blend(rates: list[tuple[int, StepRate]], x: int) -> StepRate:
    """Linear in x between the two (x_i, StepRate) around it, at each token count of either; below the first: the
    first; above the last: extrapolated from the last two, never below the last."""
    if len(rates) == 1 or x <= rates[0][0]:
        return rates[0][1]
    xs = [c for c, _ in rates]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, t0), (x1, t1) = rates[i - 1], rates[i]
    if x == x1:
        return t1
    w = (x - x0) / (x1 - x0)
    tokens = sorted(set(t0.tokens) | set(t1.tokens))
    seconds = [t0.seconds(b) + w * (t1.seconds(b) - t0.seconds(b)) for b in tokens]
    if x > x1:
        seconds = [max(s, t1.seconds(b)) for s, b in zip(seconds, tokens)]
    return StepRate(tokens, seconds)
