"""Confidence-scheduled verification (deepinfer.speculative.schedule): the step-rate table, Algorithm 1 and the budget
variant, on hand-worked examples and random instances."""

import math
import random

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.speculative.schedule import (StepRate, batch_tokens, budget_from, expected_accepted, fill, schedule_budget,
                                     schedule_fixed, schedule_greedy, survival)


def theta(conf, lengths, rate):
    """Θ = τ · SPS(B), from the helpers (independent of the schedulers' incremental sums)."""
    return expected_accepted(conf, lengths) * rate(batch_tokens(lengths))


def ranked(conf):
    """(survival, r, length) for every draft, in the module's documented order."""
    return sorted(((a, r, j + 1) for r, c in enumerate(conf) for j, a in enumerate(survival(c))),
                  key=lambda d: (-d[0], d[1], d[2]))


# --- StepRate ---------------------------------------------------------------------------------------------------

def test_step_rate_interpolates_between_points():
    rate = StepRate([1, 4, 8], [1.0, 2.5, 4.5])
    assert rate.seconds(1) == 1.0
    assert rate.seconds(4) == 2.5
    assert rate.seconds(2) == pytest.approx(1.5)      # 1.0 + (2.5 - 1.0) * (2 - 1) / (4 - 1)
    assert rate.seconds(6) == pytest.approx(3.5)      # 2.5 + (4.5 - 2.5) * (6 - 4) / (8 - 4)
    assert rate(6) == pytest.approx(1 / 3.5)          # steps per second = 1 / seconds


def test_step_rate_flat_below_and_extrapolated_above():
    rate = StepRate([2, 4, 8], [1.0, 2.5, 4.5])
    assert rate.seconds(1) == 1.0 and rate.seconds(0) == 1.0      # flat at the first point's time
    assert rate.seconds(10) == pytest.approx(5.5)                # slope (4.5 - 2.5) / 4 = 0.5: 4.5 + 0.5 * 2
    assert rate(10) == pytest.approx(1 / 5.5)
    falling = StepRate([1, 2], [2.0, 1.0])                       # slope -1 would give 1.0 - 3 = -2.0 at 5 ...
    assert falling.seconds(5) == 1.0                             # ... but never faster than the last point
    assert StepRate([3], [0.25]).seconds(100) == 0.25            # one point: flat everywhere
    assert StepRate([3], [0.25])(100) == 4.0


def test_step_rate_dict_round_trip_and_linear():
    rate = StepRate.from_dict({8: 4.5, 1: 1.0, 4: 2.5})         # any key order
    assert rate.tokens == [1, 4, 8] and rate.to_dict() == {1: 1.0, 4: 2.5, 8: 4.5}
    lin = StepRate.linear(0.5, 0.25, 6)                          # points 1, 2, 4 and 6: 0.5 + 0.25 * b
    assert lin.to_dict() == {1: 0.75, 2: 1.0, 4: 1.5, 6: 2.0}
    assert lin.seconds(3) == pytest.approx(1.25)                 # interpolated, = 0.5 + 0.25 * 3 on a line
    assert StepRate.linear(1.0, 0.0, 1).to_dict() == {1: 1.0}


@pytest.mark.parametrize("tokens, seconds, words", [
    ([], [], "as many seconds"),
    ([1, 2], [1.0], "as many seconds"),
    ([0, 2], [1.0, 2.0], "integers >= 1"),
    ([1.5, 2], [1.0, 2.0], "integers >= 1"),
    ([True, 2], [1.0, 2.0], "integers >= 1"),
    ([2, 2], [1.0, 2.0], "strictly increasing"),
    ([4, 2], [1.0, 2.0], "strictly increasing"),
    ([1, 2], [1.0, 0.0], "> 0"),
    ([1, 2], [-1.0, 2.0], "> 0"),
    ([1, 2], [1.0, math.nan], "> 0"),
    ([1, 2], [1.0, math.inf], "> 0"),
])
def test_step_rate_refuses_bad_tables(tokens, seconds, words):
    with pytest.raises(DeepInferError, match=words) as err:
        StepRate(tokens, seconds)
    assert "\n" not in str(err.value)


def test_step_rate_refuses_bad_constructors():
    with pytest.raises(DeepInferError, match="must be a dict"):
        StepRate.from_dict([(1, 1.0)])
    with pytest.raises(DeepInferError, match="max_tokens"):
        StepRate.linear(1.0, 0.1, 0)
    with pytest.raises(DeepInferError, match="must be >= 0"):
        StepRate.linear(-1.0, 0.1, 4)


# --- survival and helpers ---------------------------------------------------------------------------------------

def test_survival_prefix_products():
    assert survival([0.5, 0.5, 0.8]) == pytest.approx([0.5, 0.25, 0.2])     # 0.5, 0.5*0.5, 0.25*0.8
    assert survival([0.9, 0.0, 0.7]) == [0.9, 0.0, 0.0]                     # a zero ends the survival
    assert survival([]) == []
    assert survival([1.2, 0.5, -0.1]) == [1.0, 0.5, 0.0]                     # clipped: 1, 1*0.5, 0.5*0
    for bad in ([math.nan], [math.inf], ["0.5"], [True]):
        with pytest.raises(DeepInferError, match="must be a finite number"):
            survival(bad)


def test_expected_accepted_and_batch_tokens():
    conf = [[0.9, 0.9], [0.6, 0.5], [0.2]]
    # τ = (1 + 0.9 + 0.81) + (1 + 0.6) + 1 = 5.31;  B = (1 + 2) + (1 + 1) + (1 + 0) = 6
    assert expected_accepted(conf, [2, 1, 0]) == pytest.approx(5.31)
    assert batch_tokens([2, 1, 0]) == 6
    assert batch_tokens([]) == 0
    with pytest.raises(DeepInferError, match="2 verify lengths given for 3 requests"):
        expected_accepted(conf, [1, 1])
    with pytest.raises(DeepInferError, match="exceeds the request's 1 drafts"):
        expected_accepted(conf, [0, 0, 2])
    with pytest.raises(DeepInferError, match="integer >= 0"):
        batch_tokens([-1])


# --- Algorithm 1 ------------------------------------------------------------------------------------------------

def test_greedy_worked_example():
    conf = [[0.9, 0.9], [0.6, 0.5], [0.2]]          # survivals: [0.9, 0.81], [0.6, 0.3], [0.2]
    rate = StepRate([3, 4, 5, 6, 7, 8], [1.0, 1.2, 1.4, 1.5, 1.7, 1.75])
    # start: B=3, τ=3,                 Θ = 3 / 1.0    = 3.0
    # (0.9,  r0, 1): B=4, τ=3.9,       Θ = 3.9 / 1.2  = 3.25   > 3.0   keep
    # (0.81, r0, 2): B=5, τ=4.71,      Θ = 4.71 / 1.4 = 3.364  > 3.25  keep
    # (0.6,  r1, 1): B=6, τ=5.31,      Θ = 5.31 / 1.5 = 3.54   > 3.364 keep
    # (0.3,  r1, 2): B=7, τ=5.61,      Θ = 5.61 / 1.7 = 3.30   < 3.54  stop (not kept)
    assert schedule_greedy(conf, rate) == [2, 1, 0]
    assert theta(conf, [2, 1, 0], rate) == pytest.approx(3.54)


def test_greedy_gives_confident_requests_more_tokens():
    conf = [[0.5, 0.5], [0.9, 0.8]]                 # survivals: [0.5, 0.25], [0.9, 0.72]
    rate = StepRate([2, 3, 4, 5, 6], [1.0, 1.1, 1.25, 1.6, 2.0])
    # start: B=2, τ=2,    Θ = 2 / 1.0     = 2.0
    # (0.9,  r1, 1): B=3, τ=2.9,  Θ = 2.9 / 1.1   = 2.636 keep
    # (0.72, r1, 2): B=4, τ=3.62, Θ = 3.62 / 1.25 = 2.896 keep
    # (0.5,  r0, 1): B=5, τ=4.12, Θ = 4.12 / 1.6  = 2.575 stop
    assert schedule_greedy(conf, rate) == [0, 2]


def test_greedy_admits_everything_under_flat_rate():
    flat = StepRate([1], [1.0])                     # SPS = 1 at any B: every draft of survival > 0 raises Θ
    conf = [[0.5, 0.5], [0.1], []]
    assert schedule_greedy(conf, flat) == [2, 1, 0]
    assert schedule_greedy([[0.5, 0.0, 0.9]], flat) == [1]      # survival 0.5, 0, 0: zero-survival drafts never
    assert schedule_greedy([[1.5, -0.2]], flat) == [1]          # clipped odds: survival 1.0, 0.0


def test_greedy_admits_nothing_when_rate_halves_per_token():
    halving = StepRate([2, 3, 4, 5], [1.0, 2.0, 4.0, 8.0])
    # start: B=2, τ=2, Θ = 2 * 1 = 2; first draft (survival 1.0): B=3, τ=3, Θ = 3 * 0.5 = 1.5 < 2: stop
    assert schedule_greedy([[1.0, 1.0], [1.0]], halving) == [0, 0]
    assert schedule_greedy([], halving) == []


def test_early_stop_versus_global_argmax():
    """The paper's Appendix A: Θ(0) = 1 * 1 = 1, Θ(1) = (1 + 0.9) * 0.5 = 0.95, Θ(2) = (1 + 0.9 + 0.9) * 0.45 = 1.26.
    Algorithm 1 stops at the first non-improvement (keeping admission of draft 1 independent of draft 2); the
    budget variant, computed from stale confidences, may take the global argmax."""
    rate = StepRate([1, 2, 3], [1.0, 2.0, 1 / 0.45])           # SPS(1, 2, 3) = (1, 0.5, 0.45)
    conf = [[0.9, 1.0]]                                        # survivals 0.9, 0.9
    assert theta(conf, [1], rate) == pytest.approx(0.95) and theta(conf, [2], rate) == pytest.approx(1.26)
    assert schedule_greedy(conf, rate) == [0]
    assert budget_from(conf, rate) == 2
    assert schedule_budget(conf, 2) == [2]
    assert budget_from(conf, rate, max_extra=1) == 0           # K in [0, 1]: Θ(1) = 0.95 < Θ(0) = 1


# --- filling a CUDA graph's padding ----------------------------------------------------------------------------

def test_fill_admits_the_next_ranked_drafts():
    conf = [[0.9, 0.5], [0.8, 0.8], [0.0, 0.9]]     # survivals 0.9 0.45 | 0.8 0.64 | 0 0: ranked r0.1 r1.1 r1.2 r0.2
    assert fill(conf, [1, 0, 0], 2) == ([1, 2, 0], 2)
    assert fill(conf, [1, 0, 0], 3) == ([2, 2, 0], 3)
    assert fill(conf, [1, 0, 0], 9) == ([2, 2, 0], 3)             # survival-0 drafts are never worth a row
    assert fill(conf, [1, 0, 0], 0) == ([1, 0, 0], 0)
    assert fill(conf, [0, 0, 0], -1) == ([0, 0, 0], 0)            # no padding to fill
    with pytest.raises(DeepInferError, match="2 verify lengths given for 3 requests"):
        fill(conf, [0, 0], 1)


def first_token_a(verify_length) -> float:
    """P(the first committed token is A) under the lossless rule, for the paper's Appendix A: target (0.7, 0.3)
    over {A, B}, draft x1 ~ (0.5, 0.5) with confidence 0.9, and a second draft whose confidence depends on x1 (1
    after A, 0 after B). verify_length(conf) -> the request's verify length. Verified, x1 passes with
    min(1, p_t / p_d) (A always, B 0.6 of the time), else the residual (A); not verified, the target draws."""
    p_a = 0.0
    for x1, p_d, a_if_verified in (("A", 0.5, 1.0), ("B", 0.5, 0.4)):
        conf = [[0.9, 1.0 if x1 == "A" else 0.0]]
        p_a += p_d * (a_if_verified if verify_length(conf) >= 1 else 0.7)
    return p_a


def test_fill_after_the_early_stop_stays_lossless():
    """Appendix A's rates stop Algorithm 1 before draft 1 whatever x1 is. Padding of 2 rows then admits draft 1
    whatever x1 is (only whether draft 2 joins depends on x1: its confidence may): the first token keeps the
    target's 0.7. A look-ahead over the live confidences (a global argmax) verifies x1 only after A: 0.85."""
    rate = StepRate([1, 2, 3], [1.0, 2.0, 1 / 0.45])

    def padded(conf):
        lengths = schedule_greedy(conf, rate)
        return fill(conf, lengths, 3 - batch_tokens(lengths))[0][0]     # a graph of 3 rows
    assert first_token_a(lambda conf: schedule_greedy(conf, rate)[0]) == pytest.approx(0.7)
    assert first_token_a(padded) == pytest.approx(0.7)
    assert padded([[0.9, 1.0]]) == 2 and padded([[0.9, 0.0]]) == 1
    assert first_token_a(lambda conf: schedule_budget(conf, budget_from(conf, rate))[0]) == pytest.approx(0.85)


# --- the budget variant -----------------------------------------------------------------------------------------

def test_budget_from_worked_example_and_cap():
    stale = [[0.9, 0.8], [0.5]]                     # survivals 0.9, 0.72, 0.5 (R = 2)
    rate = StepRate([2, 3, 4, 5], [1.0, 1.1, 1.3, 1.6])
    # K=0: 2 / 1.0 = 2.0;  K=1: 2.9 / 1.1 = 2.636;  K=2: 3.62 / 1.3 = 2.785;  K=3: 4.12 / 1.6 = 2.575  -> K = 2
    assert budget_from(stale, rate) == 2
    assert budget_from(stale, rate, max_extra=1) == 1          # K in [0, 1]
    assert budget_from(stale, rate, max_extra=0) == 0
    assert budget_from(stale, rate, max_extra=10) == 2         # a cap above the 3 drafts changes nothing
    assert budget_from([], rate) == 0
    with pytest.raises(DeepInferError, match="max_extra=-1 must be an integer >= 0"):
        budget_from(stale, rate, max_extra=-1)


def test_budget_from_ties_take_the_smallest_k():
    flat = StepRate([1], [1.0])
    # survivals 0.5, 0: Θ(0) = 1, Θ(1) = 1.5, Θ(2) = (1 + 0.5 + 0) * 1 = 1.5: tie, K = 1
    assert budget_from([[0.5, 0.0]], flat) == 1
    # SPS(1, 2) = (1, 0.5), survival 1.0: Θ(0) = 1 * 1 = 1, Θ(1) = 2 * 0.5 = 1: tie, K = 0
    assert budget_from([[1.0]], StepRate([1, 2], [1.0, 2.0])) == 0


def test_schedule_budget_ranks_by_live_survival():
    live = [[0.9, 0.1], [0.5, 0.9]]                 # survivals [0.9, 0.09], [0.5, 0.45]
    # order: 0.9 (r0, 1), 0.5 (r1, 1), 0.45 (r1, 2), 0.09 (r0, 2)
    assert schedule_budget(live, 0) == [0, 0]
    assert schedule_budget(live, 1) == [1, 0]
    assert schedule_budget(live, 2) == [1, 1]
    assert schedule_budget(live, 3) == [1, 2]       # r1's second draft (conf 0.9 > 0.5) still waits for its first
    assert schedule_budget(live, 4) == [2, 2]
    assert schedule_budget(live, 9) == [2, 2]       # over the total: all admitted
    assert schedule_budget([], 3) == []
    with pytest.raises(DeepInferError, match="draft budget=-1 must be an integer >= 0"):
        schedule_budget(live, -1)


def test_schedule_budget_ties():
    assert schedule_budget([[0.5], [0.5]], 1) == [1, 0]             # equal survival: lower request first
    assert schedule_budget([[1.0, 1.0], [1.0]], 2) == [2, 0]        # 1.0 everywhere: r0's drafts 1, 2, then r1
    assert schedule_budget([[1.0, 1.0], [1.0]], 1) == [1, 0]


def test_schedule_fixed():
    conf = [[0.5, 0.5, 0.5], [], [0.9]]
    assert schedule_fixed(conf, 2) == [2, 0, 1]     # min(2, 3), min(2, 0), min(2, 1)
    assert schedule_fixed(conf, 0) == [0, 0, 0]
    assert schedule_fixed(conf, 7) == [3, 0, 1]
    with pytest.raises(DeepInferError, match="verify length=-1 must be an integer >= 0"):
        schedule_fixed(conf, -1)


# --- random instances -------------------------------------------------------------------------------------------

def _random_instance(rng):
    conf = []
    for _ in range(rng.randint(0, 8)):
        c = [rng.random() ** 0.5 for _ in range(rng.randint(0, 5))]
        if c and rng.random() < 0.1:
            c[rng.randrange(len(c))] = rng.choice([0.0, 1.0])
        conf.append(c)
    tokens = sorted(rng.sample(range(1, 60), rng.randint(1, 6)))
    if rng.random() < 0.5:                          # rising times, or a jagged table
        seconds = sorted(rng.uniform(0.5, 3.0) for _ in tokens)
    else:
        seconds = [rng.uniform(0.5, 3.0) for _ in tokens]
    return conf, StepRate(tokens, seconds)


def _cross_request_ties(conf):
    seen = {}
    for r, c in enumerate(conf):
        for a in survival(c):
            if a > 0 and seen.setdefault(a, r) != r:
                return True
    return False


@pytest.mark.parametrize("seed", range(4))
def test_greedy_properties_on_random_instances(seed):
    rng = random.Random(seed)
    permuted_checks = 0
    for _ in range(100):
        conf, rate = _random_instance(rng)
        lengths = schedule_greedy(conf, rate)
        assert len(lengths) == len(conf)
        assert all(0 <= n <= len(c) for n, c in zip(lengths, conf))
        assert theta(conf, lengths, rate) >= theta(conf, [0] * len(conf), rate)
        # the admitted drafts are the first n of the ranking (a prefix of every request, the best survivals), Θ rose
        # with each of them, and the next one (if any of survival > 0) would not have raised it
        order = [d for d in ranked(conf) if d[0] > 0]
        n = sum(lengths)
        steps = [0] * len(conf)
        thetas = [theta(conf, steps, rate)]
        for _, r, j in order[:n + 1]:
            steps[r] = j
            thetas.append(theta(conf, steps, rate))
        admitted = [0] * len(conf)
        for _, r, j in order[:n]:
            admitted[r] = j
        assert admitted == lengths
        assert all(b > a for a, b in zip(thetas[:n], thetas[1:n + 1]))
        if n < len(order):
            assert not thetas[n + 1] > thetas[n]
        # the order of the requests does not matter when no two requests share a survival value
        if conf and not _cross_request_ties(conf):
            perm = list(range(len(conf)))
            rng.shuffle(perm)
            out = schedule_greedy([conf[p] for p in perm], rate)
            unpermuted = [0] * len(conf)
            for i, p in enumerate(perm):
                unpermuted[p] = out[i]
            assert unpermuted == lengths
            permuted_checks += 1
    assert permuted_checks > 50


@pytest.mark.parametrize("seed", range(2))
def test_budget_properties_on_random_instances(seed):
    rng = random.Random(100 + seed)
    for _ in range(100):
        conf, rate = _random_instance(rng)
        total = sum(len(c) for c in conf)
        k = budget_from(conf, rate)
        assert 0 <= k <= total
        # K is a global argmax (the first one) of τ(K) · SPS(R + K) over the schedule_budget prefixes
        values = [theta(conf, schedule_budget(conf, i), rate) for i in range(total + 1)]
        assert values[k] == pytest.approx(max(values))
        assert max(values[:k], default=0.0) < values[k] + 1e-12     # no earlier K does better
        lengths = schedule_budget(conf, k)
        assert sum(lengths) == k and all(0 <= n <= len(c) for n, c in zip(lengths, conf))
        # the greedy's lengths are the top drafts by the same ranking: schedule_budget with its count agrees
        greedy = schedule_greedy(conf, rate)
        assert schedule_budget(conf, sum(greedy)) == greedy
        # and filling them with e more drafts is the top (their count + e) of the positive-survival ranking
        e = rng.randint(0, 4)
        positive = sum(a > 0 for c in conf for a in survival(c))
        filled, added = fill(conf, greedy, e)
        assert added == min(e, positive - sum(greedy))
        assert filled == schedule_budget(conf, sum(greedy) + added)


def test_profiled_rate_is_calibrated_by_the_measured_step_overhead(monkeypatch):
    """A profiled table gains the per-step time the profile did not see (EMA of launch-to-launch seconds minus
    the table's), never below zero; a given table is left as it is; an idle gap is not a step, nor is an interval
    in which a CUDA graph was captured."""
    from deepinfer.speculative import policy as policy_mod
    from deepinfer.speculative.config import SpeculativeConfig
    clock = iter([0.0, 0.010, 0.020, 5.0, 5.010, 5.5, 5.51, 6.0])
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: next(clock))
    table = StepRate.from_dict({1: 0.002, 64: 0.004})
    p = policy_mod.VerifyPolicy(SpeculativeConfig(schedule="confidence"), table, calibrate=True)
    p.launched(1)                       # t = 0
    p.launched(1)                       # 10 ms later: 8 ms beyond the table's 2 ms
    assert p.overhead == pytest.approx(0.2 * 0.008)
    p.launched(64)                      # 10 ms after a 1-token step again
    assert p.overhead == pytest.approx(0.8 * 0.2 * 0.008 + 0.2 * 0.008)
    assert p.rate.seconds(64) == pytest.approx(0.004 + p.overhead) and p.table.at(0, 1).seconds(64) == 0.004
    p.idle()
    before = p.overhead
    p.launched(1)                       # t = 5.0: after an idle gap, nothing measured
    p.launched(1)                       # t = 5.01
    assert p.overhead == pytest.approx(0.8 * before + 0.2 * 0.008)
    before = p.overhead
    p.launched(1, captured=True)        # t = 5.5: 490 ms, a graph captured on the way: skipped
    assert p.overhead == before
    p.launched(1)                       # t = 5.51: measured again from the skipped launch
    assert p.overhead == pytest.approx(0.8 * before + 0.2 * 0.008)
    given = policy_mod.VerifyPolicy(SpeculativeConfig(schedule="confidence"), table, calibrate=False)
    given.launched(1)
    assert given.overhead == 0.0 and given.rate is table
