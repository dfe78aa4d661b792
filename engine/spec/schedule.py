"""Confidence-scheduled verification for speculative decoding (DSpark, Algorithm 1).

Each decode step runs R requests; request r carries draft confidences c[r][0..γ_r-1] (floats in [0, 1]: the estimated
probability that draft j is accepted given all earlier drafts were). A schedule picks verify lengths ℓ_r in [0, γ_r].
With prefix survival a[r][j] = c[r][0] * .. * c[r][j], a step of B = Σ_r (1 + ℓ_r) tokens is expected to accept
τ = Σ_r (1 + Σ_{j<ℓ_r} a[r][j]) tokens (the 1 is the bonus token), and runs at SPS(B) steps per second (StepRate).
The schedules maximise Θ = τ · SPS(B), the expected accepted tokens per second.

Drafts are always ranked by survival descending, ties by request ascending then draft ascending: a[r][j] is
non-increasing in j, so this order admits every request's drafts as a prefix. Confidences outside [0, 1] are clipped
into it (survival)."""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Sequence

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


def survival(conf: Sequence[float]) -> list[float]:
    """Prefix products of one request's confidences: out[j] = conf[0] * .. * conf[j] (same length as conf).
    A finite confidence outside [0, 1] is clipped into it (a raw odds estimate above 1 means sure acceptance, below 0
    sure rejection: the pinned drafter reports such odds); NaN, infinities and non-numbers are refused."""
    out, p = [], 1.0
    for c in conf:
        number = type(c) is float or not isinstance(c, bool) and isinstance(c, numbers.Real)
        if not (number and math.isfinite(c)):
            raise DeepInferError(f"draft confidence {c!r} must be a finite number (a probability in [0, 1])")
        p *= min(max(float(c), 0.0), 1.0)
        out.append(p)
    return out


def _ranked(conf: Sequence[Sequence[float]], positive: bool) -> list[tuple[float, int, int]]:
    """Every draft as (-survival, request r, verify length j+1), best first: survival descending, then r, then j
    ascending (a prefix-respecting order). `positive` drops drafts of survival 0."""
    drafts = []
    for r, c in enumerate(conf):
        for j, a in enumerate(survival(c)):
            if a > 0 or not positive:
                drafts.append((-a, r, j + 1))
    drafts.sort()
    return drafts


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise DeepInferError(f"{name}={value!r} must be an integer >= 0")
    return int(value)


def batch_tokens(lengths: Sequence[int]) -> int:
    """B: the step's token count, Σ_r (1 + ℓ_r) (each request's last committed token plus its verified drafts)."""
    return sum(1 + _check_count("verify length", n) for n in lengths)


def expected_accepted(conf: Sequence[Sequence[float]], lengths: Sequence[int]) -> float:
    """τ: expected tokens the step commits, Σ_r (1 + Σ_{j<ℓ_r} a[r][j]) (the bonus token plus surviving drafts)."""
    if len(conf) != len(lengths):
        raise DeepInferError(f"{len(lengths)} verify lengths given for {len(conf)} requests")
    tau = 0.0
    for c, n in zip(conf, lengths):
        n = _check_count("verify length", n)
        if n > len(c):
            raise DeepInferError(f"verify length {n} exceeds the request's {len(c)} drafts")
        tau += 1.0 + sum(survival(c)[:n])
    return tau


def schedule_greedy(conf: Sequence[Sequence[float]], rate: StepRate) -> list[int]:
    """Algorithm 1: verify lengths ℓ (one int per request) admitting drafts best survival first while Θ = τ · SPS(B)
    strictly improves; the first admission that does not improve Θ stops the search (and is not kept), so whether
    a draft is verified never depends on the drafts after it (the losslessness condition). O(n log n) in drafts."""
    lengths = [0] * len(conf)
    if not conf:
        return lengths
    tokens = len(conf)
    tau = float(tokens)
    best = tau * rate(tokens)
    for neg_a, r, n in _ranked(conf, positive=True):
        tokens, tau = tokens + 1, tau - neg_a
        theta = tau * rate(tokens)
        if not theta > best:
            break
        best, lengths[r] = theta, n
    return lengths


def budget_from(conf_stale: Sequence[Sequence[float]], rate: StepRate, max_extra: int | None = None) -> int:
    """K, the step's draft-token budget, fixed before the step's own confidences exist (asynchronous scheduling):
    the global argmax over K in [0, min(total drafts, max_extra)] of τ(K) · SPS(R + K), with τ(K) = R + the K best
    survivals of the stale confidences (one list per request that will run). Ties: the smallest K."""
    cap = None if max_extra is None else _check_count("max_extra", max_extra)
    ranked = _ranked(conf_stale, positive=False)
    if cap is not None:
        ranked = ranked[:cap]
    tokens = len(conf_stale)
    if tokens == 0:
        return 0
    tau = float(tokens)
    best, best_k = tau * rate(tokens), 0
    for k, (neg_a, _, _) in enumerate(ranked, 1):
        tau -= neg_a
        theta = tau * rate(tokens + k)
        if theta > best:
            best, best_k = theta, k
    return best_k


def schedule_budget(conf_live: Sequence[Sequence[float]], budget: int) -> list[int]:
    """Verify lengths (one int per request) admitting the `budget` best drafts by live survival, in the ranked order
    (so each request's admitted drafts are a prefix); a budget over the total drafts admits them all."""
    budget = _check_count("draft budget", budget)
    lengths = [0] * len(conf_live)
    for _, r, n in _ranked(conf_live, positive=False)[:budget]:
        lengths[r] = n
    return lengths


def schedule_fixed(conf: Sequence[Sequence[float]], length: int) -> list[int]:
    """The comparison mode: ℓ_r = min(length, γ_r) for every request."""
    length = _check_count("verify length", length)
    return [min(length, len(c)) for c in conf]
