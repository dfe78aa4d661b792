"""EngineCore: the engine apart from the `LLM` API. One `step()` = schedule -> execute -> update from output.

    core = EngineCore(runner, manager, KernelTable("reference"), EngineConfig(...), decode, eos_token_id)
    core.add_request(req)
    while core.has_unfinished():
        finished = core.step()

Asynchronous scheduling (on by default): a step plans and launches step N+1 before it reads step N's tokens,
so the host never waits for the device before a launch; a row whose input token is still in flight reads it
on the device from the previous StepOutput (the runner's part; Request.num_inflight is the host's). Rows whose
sampling needs the previous tokens on the host (a grammar's mask needs its matcher advanced by the last token;
penalty counts are built from host output ids) do not stop that: the step's forward is launched first and the
previous step is read while it runs, before this step samples (the runner's before_sample). A step waits for
the previous tokens before planning only when the plan needs them: a running request has draft tokens (a
verify row commits 1..q+1 tokens, so the positions after it are not known before it is read), and always
while a drafter is set (it proposes from the committed tokens).

Each sampled row commits 0..q+1 tokens (engine/speculative/verify.py); the output processor advances each request
from its committed tokens only. After a verify row rejects drafts, num_computed rolls back to the positions
whose state stays valid and `on_rollback(request, num_tokens)` tells the cache (default: the runner's, else the
state manager's `rollback(request_id, num_tokens)`, else nothing).

Every step runs under the engine's kernel table (`with use(table)`); an error or interrupt inside a step
leaves the engine usable once `abort_all()` has given every seat back (LLM does it)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

from deepinfer.kernels.table import KernelTable, use

from .errors import DeepInferError
from .output_processor import OutputProcessor
from .scheduler import Request, Scheduled, Scheduler, Status
from .speculative.verify import committed_tokens
from .stats import Counters, EngineStats, graph_count, runner_fields, state_fields
from .structured import trim_illegal_drafts


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int                 # most sequences running at once (cut to the state manager's seats)
    max_num_batched_tokens: int       # positions fed per step
    max_model_len: int                # prompt + output positions per sequence
    async_scheduling: bool = True


def unsupported(params) -> str | None:
    """Why the engine cannot run these SamplingParams as asked (None when it can); one line, said up front."""
    if params.so_args is not None and params.ignore_eos:
        return ("so_args with ignore_eos=True: the grammar ends the output with EOS once it is complete; drop "
                "ignore_eos")
    return None


def invariant_chunk(budget: int) -> int:
    """Batch-invariant mode's prefill piece grid: a quarter of the step budget (at most 512), so decodes sharing
    a step rarely leave too little room for a whole piece (which then waits a step)."""
    return max(1, min(512, budget // 4))


class EngineCore:
    def __init__(self, runner, manager, kernels: KernelTable, config: EngineConfig,
                 decode: Callable[[list[int]], str], eos_token_id: int | None,
                 drafter: Callable[[Request], list[int]] | None = None, verify_policy=None, traffic=None):
        """runner: `execute(batch, prev, before_sample) -> StepOutput` (before_sample: None or a call to make
        between launching the forward and sampling); manager: a scheduler.SeatManager; decode: output ids ->
        text (stop strings); drafter: proposes a request's next draft tokens after it commits (a host hook, for
        tests); verify_policy: speculative/policy.VerifyPolicy when the runner drafts on the device (DSpark): each step
        commits what its verification accepted and takes the drafts it proposed; traffic: the model's
        parallel/traffic.ExpertTraffic counters, if it has them (reported in stats, zeroed by reset_stats)."""
        self.runner, self.manager, self.kernels, self.config = runner, manager, kernels, config
        self.traffic = traffic
        self.processor = OutputProcessor(decode, eos_token_id, config.max_model_len)
        align = invariant_chunk(config.max_num_batched_tokens) if kernels.invariant else None
        self.scheduler = Scheduler(min(config.max_num_seqs, manager.num_slots), config.max_num_batched_tokens,
                                   manager, config.max_model_len, align)
        self.drafter = drafter
        self.verify_policy = verify_policy
        self.on_rollback: Callable[[Request, int], None] = self._rollback
        self.step_observers: list[Callable[[list[Scheduled]], None]] = []   # called with each batch before launch
        self._prev = None                         # the launched step not yet read (StepOutput)
        self._prev_drafts: dict[int, list[int]] = {}   # id(Scheduled) -> the drafts its verify row fed
        self._counters = Counters()
        self._base = {"preemptions": 0, "graph_replays": 0}

    # ---- read-only settings ----
    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def num_seats(self) -> int:
        """State slots: sequences that can hold state at once."""
        return self.manager.num_slots

    @property
    def async_scheduling(self) -> bool:
        return self.config.async_scheduling

    @property
    def kernel_backend(self) -> str:
        return self.kernels.name

    @contextlib.contextmanager
    def concurrency_limit(self, n: int):
        """Inside: at most n sequences run at once (the pools stay sized for max_num_seqs; n above the seats
        runs at the seats)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise DeepInferError(f"concurrency={n!r} must be an integer >= 1")
        before = self.scheduler.max_num_seqs
        self.scheduler.max_num_seqs = min(n, self.num_seats)
        try:
            yield
        finally:
            self.scheduler.max_num_seqs = before

    # ---- requests ----
    def add_request(self, req: Request) -> None:
        why = unsupported(req.params)
        if why is None and req.params.so_args is not None:
            if req.grammar is None:
                why = "so_args needs the request's grammar matcher (LLM.generate compiles it: engine/structured.py)"
            elif self.verify_policy is not None and self.verify_policy.config.acceptance is not None:
                why = ("so_args with a pinned speculative acceptance model: pinned acceptance ignores the tokens, "
                       "so it would commit drafts the grammar refuses; drop acceptance or so_args")
        if why is not None:
            raise DeepInferError(f"request {req.request_id}: {why}")
        if not 0 < req.num_tokens < self.max_model_len:
            raise DeepInferError(f"request {req.request_id} has {req.num_tokens} tokens; max_model_len is "
                                 f"{self.max_model_len}, which must leave room for at least one generated token")
        self.scheduler.add(req)
        self._counters.requests_added += 1
        self._counters.prompt_tokens += len(req.prompt_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[Request]:
        """Stop every unfinished request (finish_reason "abort"): every seat and block goes back, nothing stays
        in flight. Returns them."""
        aborted = list(self.scheduler.running) + list(self.scheduler.waiting)
        if self.verify_policy is not None:
            self.verify_policy.idle()          # the time to the next launch is no step's
        for r in aborted:
            r.finish_reason = "abort"
            self.scheduler.finish(r)
        self._prev, self._prev_drafts = None, {}
        return aborted

    def output_text(self, req: Request) -> str:
        return self.processor.text(req)

    # ---- the loop ----
    def step(self) -> list[Request]:
        """One turn: (read the previous step first if the host needs its tokens to plan) -> plan and launch a step
        -> read the previous one. Returns the requests that finished in this turn."""
        finished: list[Request] = []
        with use(self.kernels):
            if self._prev is not None and (not self.async_scheduling or self._needs_host_outputs()):
                finished += self._update()
            if self.drafter is not None or self.verify_policy is not None:
                trim_illegal_drafts(self.scheduler.running)    # so_args requests verify legal drafts only
            if self.verify_policy is not None:
                self.verify_policy.choose(self.scheduler.running)
            batch = self.scheduler.schedule() if self.scheduler.has_unfinished() else []
            captures = graph_count(self.runner) if self.verify_policy is not None else 0
            launched = self._launch(batch, finished) if batch else None
            if launched is not None and self.verify_policy is not None:
                self.verify_policy.launched(self.runner.ran_rows, graph_count(self.runner) > captures)
            if self._prev is not None:
                finished += self._update()
            elif launched is None and self.scheduler.has_unfinished():
                raise DeepInferError("internal: the scheduler planned nothing with nothing in flight")
            if launched is not None:
                self._prev, self._prev_drafts = launched
            if not self.scheduler.has_unfinished() and self.verify_policy is not None:
                self.verify_policy.idle()             # the time until the next request is not a step's
            if not self.scheduler.has_unfinished():   # what is still in flight belongs to finished requests: its
                self._prev, self._prev_drafts = None, {}   # tokens would be dropped; the device finishes it alone
        return finished

    def _needs_host_outputs(self) -> bool:
        """Drafts (and the positions after a verify row) need the committed tokens, and a drafter proposes from
        them: such requests are not planned while a row of them is in flight."""
        return self.drafter is not None or self.verify_policy is not None or \
            any(r.spec_token_ids for r in self.scheduler.running)

    @staticmethod
    def _samples_from_host(batch: list[Scheduled]) -> bool:
        """A sampled row whose last token is in flight needs it on the host before it samples: a grammar's mask
        (the matcher advanced by it) or penalties (counts from host output ids)."""
        return any(s.num_logits and s.req.num_inflight and (s.req.grammar is not None or s.req.params.uses_penalties)
                   for s in batch)

    def _launch(self, batch: list[Scheduled], finished: list[Request]):
        """Launch the step; when its sampling needs the previous step's tokens on the host, the previous step is
        read (into `finished`) after the forward is launched and before sampling, overlapping the forward."""
        for fn in self.step_observers:
            fn(batch)
        now = time.perf_counter()
        for s in batch:
            s.req.metrics.first_scheduled_time = s.req.metrics.first_scheduled_time or now
        drafts = {id(s): list(s.req.spec_token_ids) for s in batch if s.num_logits > 1}
        read_prev = (lambda: finished.extend(self._update())) \
            if self._prev is not None and self._samples_from_host(batch) else None
        out = self.runner.execute(batch, self._prev, read_prev)
        c, fed = self._counters, sum(s.n for s in batch)
        c.steps += 1
        c.fed_tokens += fed
        c.draft_tokens += sum(len(d) for d in drafts.values())
        c.max_step_rows, c.max_step_tokens = max(c.max_step_rows, len(batch)), max(c.max_step_tokens, fed)
        for s in out.sampled:
            s.req.num_inflight += 1
        return out, drafts

    def _update(self) -> list[Request]:
        """The host side of the previous step: commit each sampled row's tokens, finish requests (their seats go
        back), roll back rejected drafts."""
        out, drafts = self._prev, self._prev_drafts
        self._prev, self._prev_drafts = None, {}
        results = out.resolve()
        spec = out.speculation()
        now, c, finished = time.perf_counter(), self._counters, []
        for i, (s, toks, lps) in enumerate(results):
            r = s.req
            r.num_inflight -= 1
            c.generated_tokens += len(toks)
            if r.status is Status.FINISHED:           # planned once more before its end was seen: dropped
                continue
            fed_drafts = drafts.get(id(s), [])
            keep = toks[:spec[i][0] + 1] if spec is not None else committed_tokens(toks, fed_drafts)
            if fed_drafts:
                r.spec_token_ids = []                 # consumed by this row
            kept = self.processor.commit(r, keep, lps[:len(keep)], now)
            c.committed_tokens += kept
            if fed_drafts:                            # a finish inside the commit drops the drafts after it
                took = min(len(keep) - 1, kept)
                c.accepted_draft_tokens += took
                _count_positions(c.drafts_at, len(fed_drafts))
                _count_positions(c.accepted_at, took)
            if s.n == s.num_logits:
                c.decode_rows += 1
                c.decode_row_tokens += kept
            if r.finish_reason is not None:
                self.scheduler.finish(r)
                c.requests_finished += 1
                finished.append(r)
                continue
            if r.status is not Status.RUNNING:        # preempted meanwhile: recomputed from scratch anyway
                continue
            if len(keep) <= len(fed_drafts):          # a draft was rejected: its position's state is stale
                r.num_computed -= len(fed_drafts) + 1 - len(keep)
                c.rollbacks += 1
                self.on_rollback(r, r.num_computed)
            if spec is not None and r.num_inflight == 0:
                r.spec_confidence_before = r.spec_confidence
                r.spec_token_ids, r.spec_confidence = list(spec[i][1]), list(spec[i][2])
            elif self.drafter is not None and r.num_inflight == 0:
                r.spec_token_ids = list(self.drafter(r))
        return finished

    def _rollback(self, req: Request, num_tokens: int) -> None:
        """The cache restores what it can; when its state holds fewer positions than num_tokens (a snapshot from
        before the verify row), the positions after it are planned again."""
        for owner in (self.runner, self.manager):
            fn = getattr(owner, "rollback", None)
            if fn is not None:
                kept = fn(req.request_id, num_tokens)
                if kept is not None and kept < req.num_computed:
                    req.num_computed = kept
                return

    # ---- statistics ----
    @property
    def stats(self) -> EngineStats:
        """A snapshot: counters since the engine was built or reset_stats(), and what it holds now."""
        runner = runner_fields(self.runner)
        runner["graph_replays"] -= self._base["graph_replays"]
        return EngineStats(**dataclasses.asdict(self._counters),
                           preemptions=self.scheduler.num_preemptions - self._base["preemptions"],
                           kernel_backend=self.kernels.name, kernel_backends=dict(self.kernels.backends),
                           async_scheduling=self.async_scheduling, **runner, **state_fields(self.manager),
                           expert_traffic=self.traffic.summary() if self.traffic is not None else None)

    def reset_stats(self) -> None:
        """Start the counters again (e.g. after a warm-up run)."""
        self._counters = Counters()
        if self.verify_policy is not None:
            self.verify_policy.reset_counts()
        if self.traffic is not None:
            self.traffic.reset()
        self._base = {"preemptions": self.scheduler.num_preemptions,
                      "graph_replays": runner_fields(self.runner)["graph_replays"]}


def _count_positions(counts: list, n: int) -> None:
    """counts[k] += 1 for k < n (growing the list as needed)."""
    counts.extend([0] * (n - len(counts)))
    for k in range(n):
        counts[k] += 1
