"""Confidence-scheduled verification for speculative decoding (the paper's Algorithm 1: docs/speculative.md).

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
import operator
from collections.abc import Sequence
from itertools import accumulate

from ..errors import DeepInferError
from .step_rate import StepRate


def survival(conf: Sequence[float]) -> list[float]:
    """Prefix products of one request's confidences: out[j] = conf[0] * .. * conf[j] (same length as conf).
    A finite confidence outside [0, 1] is clipped into it (a raw odds estimate above 1 means sure acceptance, below 0
    sure rejection: the pinned drafter reports such odds); NaN, infinities and non-numbers are refused."""
    if not all(type(c) is float and -math.inf < c < math.inf for c in conf):     # the engine's case: finite floats
        for c in conf:
            number = type(c) is float or not isinstance(c, bool) and isinstance(c, numbers.Real)
            if not (number and math.isfinite(c)):
                raise DeepInferError(f"draft confidence {c!r} must be a finite number (a probability in [0, 1])")
    return list(accumulate((min(max(float(c), 0.0), 1.0) for c in conf), operator.mul))


def ranked_drafts(conf: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """Every draft as (-survival, request r, verify length j+1), best first: survival descending, then r, then j
    ascending (a prefix-respecting order; drafts of survival 0 last). One step's schedule and fill share it."""
    drafts = [(-a, r, j + 1) for r, c in enumerate(conf) for j, a in enumerate(survival(c))]
    drafts.sort()
    return drafts


def _positive(ranked: list[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
    """The drafts of survival > 0: the ranking up to its first survival 0."""
    return ranked[:bisect.bisect_left(ranked, (0.0,))]


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


def schedule_greedy(conf: Sequence[Sequence[float]], rate: StepRate, ranked: list | None = None,
                    max_extra: int | None = None) -> list[int]:
    """Algorithm 1: verify lengths ℓ (one int per request) admitting drafts best survival first while Θ = τ · SPS(B)
    strictly improves; the first admission that does not improve Θ stops the search (and is not kept), so whether
    a draft is verified never depends on the drafts after it (the losslessness condition). O(n log n) in drafts.
    ranked: ranked_drafts(conf), when the caller has it; max_extra: admit at most that many (a cap on the count
    admitted in the ranked order, so the stop still depends on no later draft)."""
    lengths = [0] * len(conf)
    cap = None if max_extra is None else _check_count("max_extra", max_extra)
    if not conf:
        return lengths
    tokens = len(conf)
    tau = float(tokens)
    best = tau * rate(tokens)
    for neg_a, r, n in _positive(ranked_drafts(conf) if ranked is None else ranked)[:cap]:
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
    ranked = ranked_drafts(conf_stale)
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


def schedule_budget(conf_live: Sequence[Sequence[float]], budget: int, ranked: list | None = None) -> list[int]:
    """Verify lengths (one int per request) admitting the `budget` best drafts by live survival, in the ranked order
    (so each request's admitted drafts are a prefix); a budget over the total drafts admits them all. ranked:
    ranked_drafts(conf_live), when the caller has it."""
    budget = _check_count("draft budget", budget)
    lengths = [0] * len(conf_live)
    for _, r, n in (ranked_drafts(conf_live) if ranked is None else ranked)[:budget]:
        lengths[r] = n
    return lengths


def fill(conf: Sequence[Sequence[float]], lengths: Sequence[int], extra: int,
         ranked: list | None = None) -> tuple[list[int], int]:
    """Verify lengths with up to `extra` more drafts admitted: the next ones in the ranked order (survival > 0)
    after those `lengths` admits (a prefix of it, as every schedule here admits). Where a step runs as a CUDA graph
    padded to more rows than it has, the padding verifies these drafts for nothing. Lossless after Algorithm 1:
    `extra` follows from the drafts up to its early stop, and whether a draft is in the fill depends on the drafts
    ranked before it, never on a later draft of its own request (ranked after it). Returns (lengths, admitted)."""
    out = [_check_count("verify length", n) for n in lengths]
    left = _check_count("extra drafts", max(extra, 0))
    if len(out) != len(conf):
        raise DeepInferError(f"{len(out)} verify lengths given for {len(conf)} requests")
    admitted = 0
    for _, r, n in _positive(ranked_drafts(conf) if ranked is None else ranked):
        if admitted == left:
            break
        if n == out[r] + 1:
            out[r], admitted = n, admitted + 1
    return out, admitted


def schedule_fixed(conf: Sequence[Sequence[float]], length: int) -> list[int]:
    """The comparison mode: ℓ_r = min(length, γ_r) for every request."""
    length = _check_count("verify length", length)
    return [min(length, len(c)) for c in conf]
