"""Step rates for the verify schedules: seconds per engine step as a function of the step's batch tokens
(StepRate), and of the context the step's rows attend over (ContextStepRate: one StepRate per profiled context,
interpolated between them). A verify row's cost grows with its context (the sliding window, compressed entries,
the indexer's keys), so a table measured at one context gives the schedule the wrong cost slope at another."""

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


class ContextStepRate:
    """Seconds per step by (batch tokens, context): one StepRate per profiled context (positions each row's state
    holds before the step). Between two profiled contexts the seconds at each token count are interpolated
    linearly in the context; below the first the first table holds; above the last they are extrapolated from the
    last two (attention work grows linearly with context), never below the last table's. One table: every context."""

    def __init__(self, tables: Mapping[int, StepRate]):
        if not tables:
            raise DeepInferError("a context step-rate table needs at least one profiled context")
        if any(isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0 for c in tables):
            raise DeepInferError(f"step-rate contexts {sorted(tables)!r} must be integers >= 0")
        self.contexts = sorted(int(c) for c in tables)
        self.tables = [tables[c] for c in self.contexts]
        self._cache: dict[int, StepRate] = {}

    @classmethod
    def from_dict(cls, d: Mapping) -> ContextStepRate:
        """{context: {tokens: seconds}} (JSON's string keys accepted) or a plain {tokens: seconds} (every context)."""
        if d and all(isinstance(v, Mapping) for v in d.values()):
            return cls({int(c): StepRate.from_dict({int(t): s for t, s in v.items()}) for c, v in d.items()})
        return cls({0: StepRate.from_dict(dict(d))})

    def to_dict(self) -> dict[int, dict[int, float]]:
        return {c: t.to_dict() for c, t in zip(self.contexts, self.tables)}

    def at(self, context: float) -> StepRate:
        """The StepRate of steps whose rows hold `context` positions on average (rounded to an integer)."""
        c = max(int(round(context)), 0)
        hit = self._cache.get(c)
        if hit is not None:
            return hit
        cs, ts = self.contexts, self.tables
        if len(cs) == 1 or c <= cs[0]:
            rate = ts[0]
        else:
            i = min(max(bisect.bisect_left(cs, c), 1), len(cs) - 1)
            c0, c1, t0, t1 = cs[i - 1], cs[i], ts[i - 1], ts[i]
            w = (c - c0) / (c1 - c0)
            tokens = sorted(set(t0.tokens) | set(t1.tokens))
            seconds = [t0.seconds(b) + w * (t1.seconds(b) - t0.seconds(b)) for b in tokens]
            if c > c1:                                   # beyond the last context: never below its table
                seconds = [max(s, t1.seconds(b)) for s, b in zip(seconds, tokens)]
            rate = StepRate(tokens, seconds)
        if len(self._cache) < 4096:
            self._cache[c] = rate
        return rate
