"""Step rates by context (speculative/step_rate.ContextStepRate), the verify policy scheduling each step at its requests'
context, and the engine-start profile (runner/rate_profile.py) that measures them."""

import logging
from dataclasses import dataclass

import pytest
import torch

from deepinfer import LLM
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.errors import DeepInferError
from deepinfer.runner.graphs import StepGraphs, ladder, row_ladder
from deepinfer.runner.rate_profile import profile_contexts, profile_points, profile_step_rates
from deepinfer.speculative.schedule import batch_tokens, budget_from, fill, schedule_budget, schedule_greedy
from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.policy import VerifyPolicy
from deepinfer.speculative.speculation import Drafts
from deepinfer.speculative.step_rate import StepRate, StepRateTable


def linear(fixed_s: float, per_token_s: float, r: int, q: int = 6) -> StepRate:
    """A profiled row of r segments: tokens l x r for l = 1 .. q, seconds fixed_s + per_token_s x tokens."""
    return StepRate([l * r for l in range(1, q + 1)], [fixed_s + per_token_s * l * r for l in range(1, q + 1)])


def two_contexts() -> StepRateTable:
    """Context 0: 1 ms + 0.1 us a token (nearly flat); context 1000: 2 ms + 0.1 ms a token; both at 8 segments,
    and at 16 segments 1 ms more (a segment costs 1/8 ms)."""
    return StepRateTable({0: {8: linear(1e-3, 1e-7, 8), 16: linear(2e-3, 1e-7, 16)},
                          1000: {8: linear(2e-3, 1e-4, 8), 16: linear(3e-3, 1e-4, 16)}})


def test_table_interpolates_in_context_and_extrapolates_above():
    rate = two_contexts()
    assert rate.at(0, 8).to_dict() == linear(1e-3, 1e-7, 8).to_dict()
    assert rate.at(-5, 8).seconds(16) == rate.at(0, 8).seconds(16)        # below the first context: the first
    mid = rate.at(250, 8)                                                 # a quarter of the way
    assert mid.seconds(48) == pytest.approx(0.75 * (1e-3 + 48e-7) + 0.25 * (2e-3 + 48e-4))
    assert mid.tokens == [8, 16, 24, 32, 40, 48]
    above = rate.at(2000, 8)                                              # linear beyond the last context
    assert above.seconds(48) == pytest.approx(2 * (2e-3 + 48e-4) - (1e-3 + 48e-7))
    assert rate.at(1000.4, 8) is rate.at(1000, 8)                         # rounded, cached


def test_table_interpolates_in_segments_at_equal_rows_per_segment():
    rate = two_contexts()
    twelve = rate.at(1000, 12)                                            # half way from 8 to 16 segments
    assert twelve.tokens == [12, 24, 36, 48, 60, 72]
    for l in range(1, 7):                                                 # l rows each: the mean of l x 8 and l x 16
        want = 0.5 * (2e-3 + 1e-4 * 8 * l) + 0.5 * (3e-3 + 1e-4 * 16 * l)
        assert twelve.seconds(12 * l) == pytest.approx(want)
    assert rate.at(0, 3).to_dict() == rate.at(0, 8).to_dict()            # clamped to the profiled counts
    assert rate.at(0, 40).to_dict() == rate.at(0, 16).to_dict()


def test_table_never_extrapolates_below_the_last_context():
    falling = StepRateTable({0: {1: StepRate([1, 2], [2.0, 3.0])}, 10: {1: StepRate([1, 2], [1.0, 2.0])}})
    assert falling.at(30, 1).to_dict() == {1: 1.0, 2: 2.0}


def test_table_round_trips_and_takes_a_plain_table():
    rate = two_contexts()
    as_json = {str(c): {str(r): {str(t): s for t, s in row.items()} for r, row in by_r.items()}
               for c, by_r in rate.to_dict().items()}                     # a row's field, through JSON
    assert StepRateTable.from_dict(as_json).to_dict() == rate.to_dict()
    plain = StepRateTable.from_dict({1: 0.5, 4: 1.0})                     # one table: every context and count
    assert plain.at(0, 1).to_dict() == plain.at(10 ** 6, 64).to_dict() == {1: 0.5, 4: 1.0}
    with pytest.raises(DeepInferError, match="at least one profiled context"):
        StepRateTable({})
    with pytest.raises(DeepInferError, match="integers >= 0"):
        StepRateTable({-1: {1: StepRate([1], [1.0])}})
    with pytest.raises(DeepInferError, match="integers >= 1"):
        StepRateTable({0: {0: StepRate([1], [1.0])}})


@dataclass(eq=False)
class Drafting:
    """A running request as the policy reads it: the positions its state holds, and its drafts."""
    num_computed: int
    drafts: Drafts


def request(conf, computed):
    return Drafting(computed, Drafts(list(range(len(conf))), list(conf)))


def choose(policy, reqs):
    policy.choose(reqs, {r: r.drafts for r in reqs})


def test_policy_schedules_each_step_at_its_requests_context():
    """Context 0's table is nearly flat (every draft pays); context 1000's costs 1000x more a token, so
    the same drafts are cut shorter there; the policy takes the mean context of the requests it verifies."""
    policy = VerifyPolicy(SpeculativeConfig(schedule="confidence"), two_contexts())
    conf = [0.9, 0.6, 0.4, 0.3, 0.2]
    near = [request(conf, 0) for _ in range(8)]
    choose(policy, near)
    assert policy.context == 0
    near_len = [len(r.drafts.token_ids) for r in near]
    far = [request(conf, 900), request(conf, 1100)]                      # mean 1000
    far += [request(conf, 1000) for _ in range(6)]
    choose(policy, far)
    assert policy.context == 1000
    far_len = [len(r.drafts.token_ids) for r in far]
    assert near_len == [5] * 8 and max(far_len) < 5
    assert policy.rate.to_dict() == two_contexts().at(1000, 8).to_dict()


def test_calibration_reads_the_table_at_the_context_each_step_ran_at(monkeypatch):
    from deepinfer.speculative import policy as policy_mod
    clock = iter([0.0, 0.010])
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: next(clock))
    policy = VerifyPolicy(SpeculativeConfig(schedule="confidence"), two_contexts(), calibrate=True)
    choose(policy, [request([0.9], 1000) for _ in range(8)])
    policy.launched(16)                   # t = 0, 8 segments at context 1000: its table says 3.6 ms for 16 tokens
    policy.launched(16)                   # 10 ms later
    assert policy.overhead == pytest.approx(0.2 * (0.010 - (2e-3 + 16e-4)))


def test_profiled_contexts_and_points():
    assert profile_contexts(333, 6) == [0, 327]
    assert profile_contexts(2054, 6) == [0, 2048]
    assert profile_contexts(6, 6) == [0]
    assert profile_contexts(10 ** 6, 6) == [0, 2048, 16384]                   # longer: extrapolated
    assert profile_contexts(5000, 6) == [0, 2048, 4994]
    assert profile_points(16, 4, 4) == {1: [1, 2, 3, 4], 2: [2, 4, 6, 8], 4: [4, 8, 12, 16]}
    assert profile_points(10, 6, 2) == {1: [1, 2], 2: [2, 4], 4: [4, 8], 6: [6]}    # B <= max_tokens


def graphs_of(max_batch: int, max_rows: int) -> StepGraphs:
    """A StepGraphs' padding rule without a device (its ladders only)."""
    graphs = StepGraphs.__new__(StepGraphs)
    graphs.sizes, graphs.max_rows = ladder(max_batch), max_rows
    return graphs


def test_profile_points_are_the_graphs_padded_row_counts():
    """Where verify steps are graphs, the table is measured at the row counts they run as: R = 96 segments of
    1 .. 6 rows run as 96, 128, 192, 256, 384, 512 or 576 rows (the row ladder, capped at 576), never at 288 (a step
    of 288 rows runs as 384)."""
    graphs = graphs_of(96, 576)
    assert graphs.padded_rows(96, 288) == 384 and graphs.padded_rows(96, 530) == 576
    assert graphs.padded_rows(97, 10) == 10 and graphs.padded_rows(4, 600) == 600     # eager: as many as it has
    assert graphs.varlen_rows(97, 10) is None and graphs.varlen_rows(96, 288) == 384
    points = profile_points(576, 96, 6, graphs.varlen_rows)
    assert sorted(points) == [1, 2, 4, 8, 16, 32, 64, 96]
    assert points[96] == [96, 128, 192, 256, 384, 512, 576]
    assert points[64] == [64, 96, 128, 192, 256, 384]
    assert points[1] == [1, 2, 3, 4, 6]
    assert profile_points(200, 96, 6, graphs.varlen_rows)[64] == [64, 96, 128, 192, 256]   # steps of <= 200
    # 4 drafts (q = 5): 5 x 32 rows pad to 192 (a point timed with 160 rows); at the top, the cap (64 x 5 rows);
    # above the graph ladder (eager steps): l x R
    graphs = graphs_of(64, 320)
    assert profile_points(480, 64, 5, graphs.varlen_rows)[32] == [32, 48, 64, 96, 128, 192]
    assert profile_points(480, 64, 5, graphs.varlen_rows)[64] == [64, 96, 128, 192, 256, 320]
    assert profile_points(480, 64, 5, graphs_of(32, 160).varlen_rows)[64] == [64, 128, 192, 256, 320]


CONF8 = [[round(0.97 - 0.04 * r, 2), 0.8, 0.7, 0.6, 0.5] for r in range(8)]     # 8 requests' confidences


def drafting(confs, computed=100):
    return [request(c, computed) for c in confs]


def test_policy_fills_the_graph_padding_with_the_next_drafts():
    """8 requests, drafts dear enough that Algorithm 1 stops early; the graph pads the step to its rung, and the
    padding rows verify the next drafts in the ranked order. A step with a request that has no drafts may run
    eagerly: not filled. Fixed verifies every draft as before."""
    rate = StepRate.linear(1.0, 0.05, 48)
    pad = graphs_of(8, 48).padded_rows                       # rows: 8, 12, 16, 24, 32, 48
    greedy = schedule_greedy(CONF8, rate)
    assert greedy == [3, 3, 3, 3, 2, 2, 2, 2]                 # B = 28 rows: the graph runs 32
    policy = VerifyPolicy(SpeculativeConfig(schedule="confidence"), rate, pad=pad)
    reqs = drafting(CONF8)
    choose(policy, reqs)
    lengths = [len(r.drafts.token_ids) for r in reqs]
    assert lengths == [3] * 8 and policy.filled == 4        # the next 4 drafts: the third ones of requests 4 .. 7
    assert lengths == fill(CONF8, greedy, 4)[0]
    plain = drafting(CONF8) + [request([], 100)]             # one request without drafts
    choose(policy, plain)
    assert [len(r.drafts.token_ids) for r in plain[:8]] == greedy and policy.filled == 4
    fixed = VerifyPolicy(SpeculativeConfig(schedule="fixed", num_speculative_tokens=3), None, pad=pad)
    reqs = drafting(CONF8)
    choose(fixed, reqs)
    assert [len(r.drafts.token_ids) for r in reqs] == [3] * 8 and fixed.filled == 0


def test_verify_lengths_stay_within_the_token_budget():
    """max_num_batched_tokens 20 with 8 running requests leaves room for 12 drafts: Algorithm 1 (which would admit
    20, then fill to 32) admits the 12 best, the budget rule its best K <= 12 (8: 16 rows, a rung's top), the fill
    adds none; so the scheduler never cuts a verify row by what the rows before it took."""
    rate = StepRate.linear(1.0, 0.05, 48)
    pad = graphs_of(8, 48).padded_rows
    for mode in ("confidence", "budget"):
        policy = VerifyPolicy(SpeculativeConfig(schedule=mode), rate, pad=pad, max_tokens=20)
        reqs = drafting(CONF8)
        choose(policy, reqs)
        lengths = [len(r.drafts.token_ids) for r in reqs]
        if mode == "confidence":
            assert lengths == schedule_budget(CONF8, 12) and policy.filled == 0, lengths
        else:                        # its argmax over the padded cost within the room: 8 drafts, a rung's top
            assert lengths == schedule_budget(CONF8, 8) and policy.filled == 0, lengths
    assert schedule_greedy(CONF8, rate, max_extra=12) == schedule_budget(CONF8, 12)
    assert schedule_greedy(CONF8, rate, max_extra=0) == [0] * 8
    roomy = VerifyPolicy(SpeculativeConfig(schedule="confidence"), rate, pad=pad, max_tokens=30)   # room for 22: fill 2
    reqs = drafting(CONF8)
    choose(roomy, reqs)
    assert batch_tokens([len(r.drafts.token_ids) for r in reqs]) == 30 and roomy.filled == 2


def test_budget_takes_its_argmax_over_the_padded_cost():
    """The budget rule's cost is the jagged one of the rows a step runs as: flat inside a rung, so its argmax
    lands on a rung's top (the smooth table's argmax need not)."""
    rate = StepRate.linear(1.0, 0.05, 48)
    pad = graphs_of(8, 48).padded_rows
    assert 8 + budget_from(CONF8, rate) == 28                 # the smooth table's argmax: inside the rung 25 .. 32
    assert 8 + budget_from(CONF8, lambda t: rate(pad(8, t))) == 32
    policy = VerifyPolicy(SpeculativeConfig(schedule="budget"), rate, pad=pad)
    reqs = drafting(CONF8)
    choose(policy, reqs)
    assert [len(r.drafts.token_ids) for r in reqs] == schedule_budget(CONF8, 24) == [3] * 8
    assert policy.filled == 0


def test_measured_step_times_and_calibration_at_the_padded_rows(monkeypatch):
    """The policy measures each step launch to launch under its shape (segments, the rows its graph ran) and
    calibrates against the table there; steps that verified nothing are neither."""
    from deepinfer.speculative import policy as policy_mod
    clock = iter([0.0, 0.030, 0.060, 0.090, 0.100, 0.200])
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: next(clock))
    rate = StepRate([8, 12, 16], [0.010, 0.020, 0.025])
    policy = VerifyPolicy(SpeculativeConfig(schedule="confidence"), rate, calibrate=True,
                          pad=graphs_of(8, 16).padded_rows)
    choose(policy, drafting([[0.9]] * 8))
    for _ in range(4):
        policy.launched(12)          # a graph of 12 rows (the runner's ran_rows): the table says 20 ms, steps take 30
    assert policy.overhead == pytest.approx((1 - 0.8 ** 3) * 0.010)
    assert policy.step_times() == [{"segments": 8, "rows": 12, "steps": 3, "measured_ms": pytest.approx(30.0),
                                    "table_ms": pytest.approx(20.0)}]
    choose(policy, [request([], 100)])
    policy.launched(1)               # t = 0.1: the last 12-row step measured; this one verifies nothing
    policy.launched(1)               # t = 0.2: not measured
    assert policy.step_times()[0]["steps"] == 4 and len(policy.observed) == 1
    policy.reset_counts()
    assert policy.step_times() == [] and policy.filled == 0


def test_engine_profile_runs_verify_shaped_steps_at_each_context(monkeypatch):
    """The engine-start profile: a table per context and segment count with every rows-per-segment, steps of R
    segments starting at the context, one sequence each, with random tokens (not one repeated id: those route to
    a few experts), and the profile's seats given back."""
    llm = LLM(embedded_tiny_dir("deepseek_v41"), max_num_seqs=4, max_model_len=300,
              speculative={"schedule": "confidence", "num_speculative_tokens": 3})
    table = llm.engine.speculation.policy.table
    assert table.contexts == [0, 296]
    assert {r: t.tokens for r, t in table.points[0].items()} == profile_points(10 ** 6, 4, 4)
    runner, manager = llm.engine.runner, llm.engine.manager
    free = len(manager.free_slots), len(manager.free_blocks)
    seen = []
    forward = llm.model.forward

    def recording(tokens, fb):
        seen.append((tokens.clone(), fb.host))
        return forward(tokens, fb)
    monkeypatch.setattr(llm.model, "forward", recording)
    tables = profile_step_rates(runner, manager, 16, 4, [0, 256], iters=1)
    assert sorted(tables) == [0, 256] and all(sorted(t) == [1, 2, 4] for t in tables.values())
    assert all(s > 0 for by_r in tables.values() for t in by_r.values() for s in t.values())
    assert (len(manager.free_slots), len(manager.free_blocks)) == free
    steps = [(tok, host) for tok, host in seen if len(host[2]) and sum(host[2]) == tok.shape[0]]
    at256 = [(tok, host) for tok, host in steps if host[1][0] == 256]
    assert at256, "no step of the profile started at context 256"
    tok, (slots, starts, lens) = max(at256, key=lambda s: s[0].shape[0])
    assert lens == [4, 4, 4, 4] and starts == [256] * 4 and len(set(slots)) == 4 and 0 not in slots
    assert torch.unique(tok).numel() > 1


def test_profile_at_padded_rows_splits_them_evenly(monkeypatch):
    """Padded row counts that are not a multiple of the segments run as segments of as even lengths as divide:
    6 rows over 4 segments as 2, 2, 1, 1; a rung above drafts + 1 rows a segment (24 for 4 x 5) is timed with
    the most rows a step has (20: the graph pads the rest), never a segment longer than a verify row."""
    llm = LLM(embedded_tiny_dir("deepseek_v41"), max_num_seqs=4, max_model_len=300,
              speculative={"schedule": "confidence", "num_speculative_tokens": 4, "step_seconds": {1: 1e-3}})
    seen = []
    forward = llm.model.forward

    def recording(tokens, fb):
        seen.append(fb.host)
        return forward(tokens, fb)
    monkeypatch.setattr(llm.model, "forward", recording)
    tables = profile_step_rates(llm.engine.runner, llm.engine.manager, 20, 4, [0], iters=1, pad=lambda r, b: row_ladder(b))
    assert {r: sorted(t) for r, t in tables[0].items()} == {1: [1, 2, 3, 4, 6], 2: [2, 3, 4, 6, 8, 12],
                                                            4: [4, 6, 8, 12, 16, 24]}
    lens = [host[2] for host in seen if len(host[2]) == 4]
    assert [2, 2, 1, 1] in lens and [3, 3, 3, 3] in lens
    assert max(max(host[2]) for host in seen) == 5          # 24 rows (the rung of 20) timed as 4 segments of 5


def test_profile_skips_a_context_the_pools_cannot_hold(caplog):
    """With entry blocks for 4 short sequences but not for 4 of 256 positions, context 256 is skipped with a
    warning (the policy then extrapolates from context 0's table) and nothing is left seated."""
    llm = LLM(embedded_tiny_dir("deepseek_v41"), max_num_seqs=4, max_model_len=300,
              speculative={"schedule": "confidence", "num_speculative_tokens": 3,
                           "step_seconds": {1: 1e-3, 16: 2e-3}})
    manager = llm.engine.manager
    keep = 4 * manager.layout.blocks_for(4)
    assert 4 * manager.layout.blocks_for(260) > keep
    held = manager.free_blocks[keep:]
    del manager.free_blocks[keep:]
    try:
        with caplog.at_level(logging.WARNING, logger="deepinfer"):
            tables = profile_step_rates(llm.engine.runner, manager, 16, 4, [0, 256], iters=1)
        assert sorted(tables) == [0]
        assert "context 256 is not profiled" in caplog.text
        assert len(manager.free_blocks) == keep and len(manager.free_slots) == 4
    finally:
        manager.free_blocks.extend(held)
