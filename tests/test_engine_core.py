"""The scheduler and the engine core against a fake model (pure Python, no torch model): step budgets, seats,
chunked prefill, preemption when blocks run out, verify rows that commit 1..q+1 tokens (drafts accepted and
rejected, num_computed rolled back: the fake runner returns hand-made verdicts and next drafts, as a drafting
runner would), stop strings / stop ids / max_tokens inside multi-token commits,
min_tokens, logprobs trimmed with their tokens, asynchronous scheduling on == off, steps that must wait for
host outputs, an interrupted run giving every seat back, so_args without a matcher refused, statistics.

The fake model: the token after position p is f(token at p, p, prompt[0]) — it depends on the token fed, so a
wrong input (a stale in-flight read, an unrolled-back draft) changes the outputs; the fake state manager keeps
the tokens each request's state holds and the fake runner asserts every row extends exactly that state."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.core import EngineConfig, EngineCore, invariant_chunk
from deepinfer.errors import DeepInferError
from deepinfer.kernels.table import KernelTable
from deepinfer.output_processor import OutputProcessor
from deepinfer.sampling import SamplingParams
from deepinfer.runner.speculate import Rows, Speculator
from deepinfer.scheduler import Request, ScheduledRow, Scheduler, Status
from deepinfer.speculative.config import SpeculativeConfig
from deepinfer.speculative.speculation import Drafts, Speculation

V, EOS = 64, 63
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def f(tok: int, pos: int, seed: int) -> int:
    return (tok * 31 + pos * 17 + seed * 7) % V


def decode(ids: list[int]) -> str:
    return "".join(ALPHABET[t % 26] for t in ids)


def reference(prompt: list[int], n: int) -> list[int]:
    """One-at-a-time decoding of the fake model."""
    stream = list(prompt)
    for _ in range(n):
        stream.append(f(stream[-1], len(stream) - 1, prompt[0]))
    return stream[len(prompt):]


class FakeManager:
    """Seats and blocks of `block_tokens` positions, as StateManager hands them out; `cache[rid]` = the tokens
    whose state the request holds (positions 0..k-1)."""

    def __init__(self, num_slots: int, num_blocks: int, block_tokens: int = 4):
        self.num_slots, self.block_tokens = num_slots, block_tokens
        self.free_slots, self.free_blocks = list(range(num_slots, 0, -1)), list(range(num_blocks, 0, -1))
        self.owned: dict[str, tuple[int, list[int]]] = {}
        self.cache: dict[str, list[int]] = {}
        self.rollbacks: list[tuple[str, int]] = []

    def match_prefix(self, rid: str, tokens: list[int], align=None):
        return None                      # the fake cache shares no prefix

    def cache_blocks(self, rid: str, num_tokens: int, tokens) -> None:
        pass

    def interior_snapshots(self, rows, align) -> dict:
        return {}                        # no prefix cache, so no ring snapshots

    def keep_boundaries(self, rows, align) -> None:
        """No prefix cache, so no ring snapshots to keep."""

    def forget_prefixes(self) -> None:
        pass

    def reserve(self, rid: str, num_tokens: int, hit=None) -> bool:
        assert hit is None
        slot, blocks = self.owned.get(rid, (None, []))
        need = math.ceil(num_tokens / self.block_tokens) - len(blocks)
        if (slot is None and not self.free_slots) or need > len(self.free_blocks):
            return False
        slot = self.free_slots.pop() if slot is None else slot
        self.owned[rid] = (slot, blocks + [self.free_blocks.pop() for _ in range(max(need, 0))])
        return True

    def release(self, rid: str) -> None:
        slot, blocks = self.owned.pop(rid, (None, []))
        if slot is not None:
            self.free_slots.append(slot)
            self.free_blocks.extend(blocks)
        self.cache.pop(rid, None)

    def slot(self, rid: str) -> int:
        return self.owned[rid][0]

    def snapshot_unless_slack(self, rid: str, num_tokens: int, drafts: int) -> None:
        pass                             # the fake cache rolls back by position

    def restore(self, rid: str, num_tokens: int) -> int:
        self.rollbacks.append((rid, num_tokens))
        del self.cache[rid][num_tokens:]
        return num_tokens

    def usage(self) -> dict:
        return {"num_seats": self.num_slots, "free_seats": len(self.free_slots), "num_blocks": None,
                "free_blocks": len(self.free_blocks), "block_tokens": None, "state_bytes": None,
                "state_summary": None}


class FakeOutput:
    def __init__(self, runner, step, sampled, tokens, lps, verdicts):
        self.runner, self.step, self.sampled, self.tokens, self.lps = runner, step, sampled, tokens, lps
        self.verdicts, self.prompt_logprobs = verdicts, []
        self.index = {s.request_id: i for i, s in enumerate(sampled)}

    def wait(self):
        """The fake's tokens are on the host already."""

    def resolve(self):
        self.runner.events.append(("resolve", self.step))
        return list(zip(self.sampled, self.tokens, self.lps))

    def speculation(self):
        return self.verdicts


class FakeRunner:
    """propose(prompt, outputs) -> the next drafts of a request whose outputs are `outputs` (None: drafts
    nothing): with it the runner verifies each verify row (drafts accepted while they equal the samples) and
    returns the next drafts, as a drafting runner does on the device."""

    def __init__(self, manager: FakeManager, propose=None):
        self.manager, self.propose, self.events, self.graph_replays, self.steps = manager, propose, [], 0, 0
        self.ran_rows, self.cuda_graphs = 0, False

    def graph_keys(self) -> list:
        return []

    def execute(self, plan, prev, before_sample=None, ring_marks=None):
        assert not ring_marks
        self.steps += 1
        self.events.append(("execute", self.steps))
        sampled, tokens, lps, verdicts = [], [], [], []
        for s in plan.rows:
            r = s.request
            _, blocks = self.manager.owned[r.request_id]
            assert len(blocks) * self.manager.block_tokens >= s.start + s.n          # reserved before the step
            cache = self.manager.cache.setdefault(r.request_id, [])
            assert s.start == len(cache), (r.request_id, s.start, len(cache))          # extends its state exactly
            known = min(s.start, r.num_tokens)
            assert cache[:known] == r.tokens(0, known)                                # no stale (rejected) draft
            for k, p in enumerate(range(s.start, s.start + s.n)):
                if k >= len(s.token_ids):                          # its input is the previous step's sample
                    assert s.n == 1 and not s.draft_ids
                    cache.append(prev.tokens[prev.index[r.request_id]][-1])
                else:
                    cache.append(s.token_ids[k])
            if s.num_logits:
                first = s.start + s.n - s.num_logits
                toks = [f(cache[p], p, r.prompt_ids[0]) for p in range(first, s.start + s.n)]
                sampled.append(s)
                tokens.append(toks)
                lps.append([{t: -p / 1000} if r.params.logprobs is not None else None
                            for t, p in zip(toks, range(first, s.start + s.n))])
                if self.propose is not None:
                    accepted = 0
                    while accepted < len(s.draft_ids) and toks[accepted] == s.draft_ids[accepted]:
                        accepted += 1
                    outputs = r.output_ids + toks[:accepted + 1]
                    verdicts.append((accepted, self.propose(r.prompt_ids, outputs), [1.0] * 8))
        self.graph_replays += all(s.n == 1 for s in plan.rows)        # "decode-only steps replay a graph"
        if before_sample is not None:            # the engine's host work between forward and sampling
            before_sample()
            self.events.append(("sample", self.steps))
        return FakeOutput(self, self.steps, sampled, tokens, lps, verdicts if self.propose is not None else None)


def make_core(num_slots=4, num_blocks=64, budget=16, max_num_seqs=4, max_model_len=64, async_scheduling=True,
              propose=None, backend="reference", block_tokens=4):
    manager = FakeManager(num_slots, num_blocks, block_tokens)
    config = EngineConfig(max_num_seqs, budget, max_model_len, async_scheduling)
    speculation = Speculation(None, max_model_len) if propose is not None else None
    return EngineCore(FakeRunner(manager, propose), manager, KernelTable(backend), config, decode, EOS, speculation)


def make_requests(prompts, **params):
    sp = SamplingParams(**{"temperature": 0, "ignore_eos": True, **params})
    return [Request(str(i), list(p), sp, seed=0) for i, p in enumerate(prompts)]


def run(core, requests, record=None):
    for r in requests:
        core.add_request(r)
    if record is not None:
        core.step_observers.append(lambda b: record.append([(s.request_id, s.start, s.n, s.num_logits)
                                                            for s in b]))
    finished = []
    while core.has_unfinished():
        finished += core.step()
    return finished


def drafter_with(q: int, wrong_at):
    """Proposes q drafts: the fake model's true next tokens, except the one at index wrong_at(number of outputs)
    (None: all right), so the row accepts exactly that many."""
    def propose(prompt: list[int], outputs: list[int]) -> list[int]:
        bad = wrong_at(len(outputs))
        return [(t + 1) % V if i == bad else t for i, t in enumerate(reference(prompt + outputs, q))]
    return propose


PROMPTS = [[5, 9, 2, 7, 1, 3, 8, 4, 6, 10, 11], [20, 1], [33, 4, 4, 4, 4, 4, 4], [7] * 13, [50, 2, 9], [12, 13]]


def commit(sampled: list[int], drafts: list[int]) -> list[int]:
    """The engine's one commit rule on a greedy row: the runner's verification (runner/speculate.py) says how many
    drafts are accepted, the row commits that many samples and one more."""
    q = len(sampled)
    row = ScheduledRow(None, "r", 1, 0, len(drafts) + 1, q, tuple(drafts), tuple(drafts), 0, 0,
                       SamplingParams(temperature=0), 0, [], [], None)
    verdict = Speculator(None, None, SpeculativeConfig(), invariant=False)
    view, accepted = verdict.verify(Rows.of([row], [0], "cpu"), torch.zeros(q, V), None, torch.tensor(sampled))
    return view[:int(accepted[0]) + 1].tolist()


# ---- the pure pieces ----
def test_commit_rule():
    assert commit([4], []) == [4]
    assert commit([4, 5, 6], [4, 5]) == [4, 5, 6]         # all accepted: q + 1 tokens
    assert commit([4, 9, 6], [4, 5]) == [4, 9]            # d_2 rejected: s_1 replaces it
    assert commit([3, 5, 6], [4, 5]) == [3]               # d_1 rejected: one token
    with pytest.raises(ValueError, match="samples 3 positions"):
        commit([1, 2], [1, 2])


def test_processor_trims_a_commit_at_max_tokens_and_logprobs_with_it():
    proc = OutputProcessor(decode, EOS, 100)
    r = make_requests([[1, 2]], max_tokens=4, logprobs=0)[0]
    assert proc.commit(r, [10, 11], [{10: -0.1}, {11: -0.2}], 1.0) == 2 and r.finish_reason is None
    assert proc.commit(r, [12, 13, 14], [{12: -0.3}, {13: -0.4}, {14: -0.5}], 2.0) == 2
    assert r.output_ids == [10, 11, 12, 13] and r.finish_reason == "length"
    assert r.logprobs == [{10: -0.1}, {11: -0.2}, {12: -0.3}, {13: -0.4}]
    assert r.metrics.token_times == [1.0, 1.0, 2.0, 2.0] and r.metrics.finished_time == 2.0


# ---- scheduler ----
def test_scheduler_drafts_are_cut_by_budget_and_the_row_samples_each_fed_one():
    m = FakeManager(2, 16)
    sched = Scheduler(2, 3, m, 64)
    r = make_requests([[1, 2, 3, 4]], max_tokens=10)[0]
    sched.add(r)
    assert [(s.start, s.n, s.num_logits) for s in sched.schedule().rows] == [(0, 3, 0)]   # a piece short of the end
    assert [(s.start, s.n, s.num_logits) for s in sched.schedule().rows] == [(3, 1, 1)]   # reaches it: samples
    r.output_ids = [9]                                                 # committed 9 (the row read)
    sched.row_read(r)
    plan = sched.schedule({r: (5, 6, 7)})                             # drafts for positions 5..7
    assert [(s.start, s.n, s.num_logits) for s in plan.rows] == [(4, 3, 3)]   # 9, 5, 6: budget 3
    assert plan.rows[0].draft_ids == (5, 6) and r.num_computed == 7   # the draft that did not fit is dropped
    assert m.owned[r.request_id][1] and len(m.owned[r.request_id][1]) == 2            # blocks for 7 positions


def test_scheduler_drafts_are_cut_to_max_tokens_and_never_planned_in_flight():
    m = FakeManager(2, 16)
    sched = Scheduler(2, 16, m, 64)
    r = make_requests([[1, 2]], max_tokens=3)[0]
    sched.add(r)
    sched.schedule()
    r.output_ids, r.num_computed = [7], 2
    sched.row_read(r)
    speculation = Speculation(None, 64)
    speculation.drafts[r] = Drafts([1, 2, 3, 4], [1.0] * 4)
    (s,) = sched.schedule(speculation.plan([r])).rows
    assert s.num_logits == 2 and s.draft_ids == (1,)                 # 1 output + commits of <= 2 = max_tokens
    r.num_inflight = 1
    assert sched.schedule({r: (1,)}).rows == ()                       # drafts + a row in flight: wait


# ---- the engine core ----
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_budgets_seats_chunked_prefill_and_preemption(async_scheduling):
    """6 requests, 3 seats, 8-token steps, 8 blocks of 4 positions for sequences of up to 23 positions: pieces
    are chunked, the newest sequences are preempted and recomputed, and every output equals one-at-a-time
    decoding."""
    core = make_core(num_slots=3, num_blocks=8, budget=8, max_num_seqs=3, async_scheduling=async_scheduling)
    reqs, steps = make_requests(PROMPTS, max_tokens=10), []
    run(core, reqs, steps)
    for r, p in zip(reqs, PROMPTS):
        assert r.output_ids == reference(p, 10) and r.finish_reason == "length" and r.status is Status.FINISHED
        assert len(r.metrics.token_times) == 10
    assert all(sum(n for _, _, n, _ in st) <= 8 and len(st) <= 3 for st in steps)
    assert any(lg == 0 for st in steps for *_, lg in st)                       # pieces short of the end
    st = core.stats
    assert st.preemptions > 0 and st.steps == len(steps) == core.runner.steps
    assert st.committed_tokens == 60 and st.prompt_tokens == sum(map(len, PROMPTS)) and st.requests_finished == 6
    assert st.max_step_tokens <= 8 and st.max_step_rows <= 3
    assert st.fed_tokens > st.prompt_tokens + 60 - 6                           # recompute fed positions again
    assert st.free_seats == 3 and st.free_blocks == 8 and st.num_seats == 3 and not core.manager.cache


def test_async_on_equals_off_and_overlaps():
    outs, events = {}, {}
    for on in (True, False):
        core = make_core(async_scheduling=on)
        reqs = make_requests(PROMPTS, max_tokens=12, logprobs=1)
        run(core, reqs)
        outs[on] = [(r.output_ids, r.logprobs, r.finish_reason) for r in reqs]
        events[on] = core.runner.events
    assert outs[True] == outs[False]
    assert outs[True][0][0] == reference(PROMPTS[0], 12)

    def overlapped(ev):      # step k+1 launched before step k was read
        return any(ev.index(("execute", k + 1)) < ev.index(("resolve", k)) for k in range(1, 10)
                   if ("resolve", k) in ev and ("execute", k + 1) in ev)
    assert overlapped(events[True]) and not overlapped(events[False])


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.2), dict(frequency_penalty=0.5)])
def test_penalty_rows_sample_without_reading_the_previous_step(params):
    """A penalty row's last token is counted on the device (the runner's in_flight counts): the loop overlaps
    as without penalties (step k+1 launched before step k is read) and never reads a step before sampling.
    (The fake runner's tokens do not see penalties; tests/test_structured_outputs.py and
    tests/test_llm.py compare real penalty outputs async vs sync.)"""
    outs = {}
    for on in (True, False):
        core = make_core(async_scheduling=on)
        reqs = make_requests(PROMPTS[:1], max_tokens=6) + [Request("p", [3, 4], SamplingParams(
            temperature=0, max_tokens=6, ignore_eos=True, **params), seed=0)]
        run(core, reqs)
        outs[on] = [r.output_ids for r in reqs]
        ev = core.runner.events
        assert not any(e[0] == "sample" for e in ev)
        overlapped = [k for k in range(1, core.runner.steps) if ("resolve", k) in ev
                      and ev.index(("execute", k + 1)) < ev.index(("resolve", k))]
        assert len(overlapped) >= 4 if on else not overlapped
    assert outs[True] == outs[False]


def test_the_loop_time_is_split_without_double_counting(monkeypatch):
    """A launch of 2 ms and a read that waits 3 ms: plan, launch, wait and apply add up to no more than the loop's
    wall time although a row reads the previous step inside the launch (counted as wait and apply, not launch),
    and each part holds at least what it slept."""
    import time
    launch = FakeRunner.execute
    monkeypatch.setattr(FakeRunner, "execute", lambda self, *a, **k: (time.sleep(0.002), launch(self, *a, **k))[1])
    monkeypatch.setattr(FakeOutput, "wait", lambda self: time.sleep(0.003))
    core = make_core()          # every row in flight reads the previous step before sampling, as a grammar row does
    monkeypatch.setattr(type(core), "_samples_from_host",
                        staticmethod(lambda plan: any(r.num_logits and r.num_in_flight for r in plan.rows)))
    reqs = make_requests(PROMPTS[:1], max_tokens=6) + [Request("p", [3, 4], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.2), seed=0)]
    t = time.perf_counter()
    run(core, reqs)
    wall, s = time.perf_counter() - t, core.stats
    reads = sum(e[0] == "resolve" for e in core.runner.events)
    nested = sum(e[0] == "sample" for e in core.runner.events)
    assert nested >= 4 and reads >= s.steps - 1
    assert s.host_launch_s >= 0.002 * s.steps and s.device_wait_s >= 0.003 * reads
    assert s.host_plan_s > 0 and s.host_apply_s > 0
    assert s.host_plan_s + s.host_launch_s + s.device_wait_s + s.host_apply_s <= wall
    core.reset_stats()
    assert core.stats.host_launch_s == core.stats.device_wait_s == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_verify_rows_commit_accepted_drafts_and_roll_back_rejected_ones(async_scheduling):
    """q = 3 drafts whose first wrong one moves with the output length: rows commit 1..4 tokens; outputs equal
    one-at-a-time decoding; after a rejection num_computed (and the fake cache, through the rollback hook)
    return to the committed positions."""
    pattern = lambda n_out: [None, 0, 1, 2][n_out % 4]          # noqa: E731  accept 3, 0, 1, 2
    core = make_core(propose=drafter_with(3, pattern), async_scheduling=async_scheduling)
    reqs, steps = make_requests(PROMPTS[:4], max_tokens=20, logprobs=0), []
    run(core, reqs, steps)
    for r, p in zip(reqs, PROMPTS):
        assert r.output_ids == reference(p, 20) and r.finish_reason == "length"
        assert [next(iter(e)) for e in r.logprobs] == r.output_ids
    assert any(lg == 4 for st in steps for *_, lg in st)                       # verify rows of 3 drafts
    st = core.stats
    assert st.draft_tokens > st.accepted_draft_tokens > 0 and st.rollbacks > 0
    assert st.committed_tokens == 80 and st.steps < 20           # one token a step would take 20 + 1 steps
    assert len(core.manager.rollbacks) == st.rollbacks
    rid, n = core.manager.rollbacks[0]
    assert n >= len(PROMPTS[int(rid)])


def test_drafts_are_not_planned_while_in_flight_and_rows_never_read_stale_state():
    core = make_core(propose=drafter_with(2, lambda n: 1), async_scheduling=True)
    reqs = make_requests(PROMPTS[:3], max_tokens=9)
    run(core, reqs)                   # the fake runner asserts every row extends exactly the state it holds
    assert [r.output_ids for r in reqs] == [reference(p, 9) for p in PROMPTS[:3]]
    ev = core.runner.events
    assert all(ev.index(("resolve", k - 1)) < ev.index(("execute", k)) for k in range(3, core.runner.steps + 1))


def test_stop_string_completed_inside_a_three_token_commit():
    """Perfect drafts (q = 2): the prefill commits token 0, then each verify row commits 3 (1-3, 4-6, ...). A
    stop string made of tokens 4 and 5 completes on the middle token of a commit: token 6 and its logprob are
    dropped, the text ends before the stop string."""
    prompt = next(p for p in ([s, 3, 1] for s in range(V))
                  if decode(reference(p, 8))[4:6] not in decode(reference(p, 8))[:5])
    ref = reference(prompt, 8)
    stop = decode(ref)[4:6]
    core = make_core(propose=drafter_with(2, lambda n: None))
    (r,) = make_requests([prompt], max_tokens=8, stop=[stop], logprobs=0)
    steps = []
    run(core, [r], steps)
    assert [lg for st in steps for *_, lg in st] == [1, 3, 3]             # commits of 1, 3 and 3 tokens
    assert r.output_ids == ref[:6] and r.finish_reason == "stop" and r.stop_reason == stop
    assert len(r.logprobs) == 6 and core.output_text(r) == decode(ref)[:4]
    assert core.stats.committed_tokens == 6 and core.stats.generated_tokens == 7


def find_prompt(cond, n: int = 16) -> list[int]:
    """A fake-model prompt whose one-at-a-time continuation of n tokens satisfies cond."""
    return next(p for p in ([s, t, 1] for s in range(V) for t in range(V)) if cond(reference(p, n)))


@pytest.mark.parametrize("min_tokens", [0, 5])
def test_stop_token_inside_a_commit_respects_min_tokens(min_tokens):
    """Perfect drafts (q = 3): commits of 1, 4, 4, ... tokens. A stop id first produced at index 1-3 (before
    min_tokens=5: kept, no stop) and again later: the output ends at the first occurrence from min_tokens on."""
    early = lambda ref: [x for x in ref[1:4] if ref.index(x) >= 1 and x in ref[5:14]]   # noqa: E731
    prompt = find_prompt(lambda ref: bool(early(ref)))
    ref = reference(prompt, 16)
    stop_id = early(ref)[0]
    want = next(i for i, t in enumerate(ref) if t == stop_id and i + 1 >= min_tokens)
    assert want == (ref.index(stop_id) if min_tokens == 0 else ref.index(stop_id, 4))
    core = make_core(propose=drafter_with(3, lambda n: None))
    (r,) = make_requests([prompt], max_tokens=16, stop_token_ids=[stop_id], min_tokens=min_tokens, logprobs=0)
    run(core, [r])
    assert r.output_ids == ref[:want + 1] and r.finish_reason == "stop" and r.stop_reason == stop_id
    assert len(r.logprobs) == want + 1


def test_stop_string_text_before_min_tokens_is_never_matched():
    """The first token's character reappears later; with min_tokens=3 the first occurrence cannot stop the
    request, the first one produced from token 3 on does."""
    prompt = find_prompt(lambda ref: decode(ref)[0] in decode(ref)[2:12])
    ref = reference(prompt, 16)
    text, ch = decode(ref), decode(ref)[0]
    at = text.index(ch, 2)
    for min_tokens, want in ((0, 0), (3, at)):
        core = make_core(propose=drafter_with(2, lambda n: None))
        (r,) = make_requests([prompt], max_tokens=16, stop=[ch], min_tokens=min_tokens)
        run(core, [r])
        assert r.finish_reason == "stop" and r.output_ids == ref[:want + 1] and core.output_text(r) == text[:want]


def test_max_tokens_and_eos_inside_commits():
    """Perfect drafts (q = 3) commit 1, 4, 4 tokens: max_tokens=6 ends exactly at 6 (drafts past it are never
    fed); an EOS that is not the last token of its commit ends the output there."""
    prompt = find_prompt(lambda ref: EOS in ref and ref.index(EOS) in (2, 3, 6, 7), 12)
    ref = reference(prompt, 12)
    core = make_core(propose=drafter_with(3, lambda n: None))
    a = Request("len", list(prompt), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), seed=0)
    b = Request("eos", list(prompt), SamplingParams(temperature=0, max_tokens=12), seed=0)
    steps = []
    run(core, [a, b], steps)
    assert a.output_ids == ref[:6] and a.finish_reason == "length"
    assert b.output_ids == ref[:ref.index(EOS) + 1] and b.finish_reason == "stop" and b.stop_reason is None
    assert [lg for st in steps for rid, *_, lg in st if rid == "len"] == [1, 4, 1]


def test_batch_invariant_prefill_pieces_sit_on_a_fixed_grid():
    core = make_core(budget=16, backend="invariant")
    assert core.kernel_backend == "invariant" and core.scheduler.chunk_align == invariant_chunk(16) == 4
    steps = []
    reqs = make_requests(PROMPTS, max_tokens=4)
    run(core, reqs, steps)
    for st in steps:
        for rid, start, n, lg in st:
            if start < len(PROMPTS[int(rid)]) - 1:                     # prompt pieces: [4k, 4(k+1)) or a tail
                assert start % 4 == 0 and (n == 4 or start + n == len(PROMPTS[int(rid)])), (rid, start, n)
    assert [r.output_ids for r in reqs] == [reference(p, 4) for p in PROMPTS]
    assert core.stats.kernel_backends["linear"] == "invariant"


def test_concurrency_limit_is_temporary():
    core = make_core(num_slots=4, max_num_seqs=4)
    steps = []
    with core.concurrency_limit(2):
        assert core.scheduler.max_num_seqs == 2
        run(core, make_requests(PROMPTS, max_tokens=3), steps)
    assert max(len(st) for st in steps) == 2 and core.scheduler.max_num_seqs == 4 and core.max_num_seqs == 4
    with pytest.raises(DeepInferError, match="concurrency=0"):
        with core.concurrency_limit(0):
            pass


def test_an_interrupted_run_gives_every_seat_back():
    core = make_core(num_slots=3, num_blocks=20)
    calls = []

    def interrupt(batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
    core.step_observers.append(interrupt)
    reqs = make_requests(PROMPTS, max_tokens=8)
    with pytest.raises(KeyboardInterrupt):
        run(core, reqs)
    aborted = core.abort_all()
    assert aborted and all(r.finish_reason == "abort" for r in aborted) and not core.has_unfinished()
    assert sorted(core.manager.free_slots) == [1, 2, 3] and len(core.manager.free_blocks) == 20
    core.step_observers.clear()
    (r,) = make_requests([PROMPTS[0]], max_tokens=5)
    run(core, [r])
    assert r.output_ids == reference(PROMPTS[0], 5)


def test_so_args_without_a_grammar_matcher_is_refused_before_any_work():
    """The engine core applies a request's grammar matcher (LLM.generate compiles it); so_args without one, or
    with ignore_eos, is one line before any step."""
    core = make_core()
    for sp, why in ((SamplingParams(so_args={"regex": "a+"}), "so_args needs the request's grammar matcher"),
                    (SamplingParams(so_args={"regex": "a+"}, ignore_eos=True), "so_args with ignore_eos=True")):
        with pytest.raises(DeepInferError) as err:
            core.add_request(Request("7", [1, 2], sp, seed=0))
        assert str(err.value).startswith(f"request 7: {why}") and "\n" not in str(err.value)
    assert not core.has_unfinished() and core.runner.steps == 0 and core.stats.requests_added == 0


def test_stats_snapshot_and_reset():
    core = make_core()
    run(core, make_requests(PROMPTS[:2], max_tokens=5))
    st = core.stats
    assert st.graph_replays == core.runner.graph_replays > 0 and st.kernel_backend == "reference"
    assert st.generated_tokens >= st.committed_tokens == 10 and st.to_dict()["steps"] == st.steps
    assert st.num_blocks is None and st.state_bytes is None        # the fake manager has no pools to report
    core.reset_stats()
    st2 = core.stats
    assert st2.steps == 0 and st2.graph_replays == 0 and st2.preemptions == 0 and st2.committed_tokens == 0
    assert st.steps > 0                                             # the earlier snapshot is unchanged
