"""EngineCore: the engine apart from the `LLM` API. One `step()` = plan -> run -> apply.

    core = EngineCore(runner, manager, KernelTable("reference"), EngineConfig(...), decode, eos_token_id)
    core.add_request(req)
    while core.has_unfinished():
        finished = core.step()

plan: speculation (when on) says which drafts each running request verifies, the scheduler freezes the step's
plan (scheduler/plan.py); run: the runner launches it and returns plain results (runner/runner.StepOutput);
apply: each sampled row commits its tokens (a verify row: its accepted drafts and one more), requests finish
(their seats go back), rejected drafts roll back (the scheduler's rollback, through the state cache's restore).
Only the scheduler and the output processor write a Request.

Asynchronous scheduling (on by default): a step plans and launches step N+1 before it reads step N's tokens,
so the host never waits for the device before a launch; a row whose input token is still in flight reads it
on the device from the previous StepOutput (the runner's part; Request.num_inflight is the host's). Rows whose
sampling needs the previous tokens on the host (a grammar's mask needs its matcher advanced by the last token)
do not stop that: the step's forward is launched first and the previous step is read while it runs, before this
step samples (the runner's before_sample). Penalty rows need no read: the runner counts their token in flight on
the device. With speculation
a step reads the previous one before planning: a verify row commits 1..q+1 tokens, so the positions after it
are not known before it is read (engine/speculative/speculation.py).

Every step runs under the engine's kernel table (`with use(table)`); an error or interrupt inside a step
leaves the engine usable once `abort_all()` has given every seat back (LLM does it)."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from deepinfer.kernels.table import KernelTable, use

from .errors import DeepInferError
from .output_processor import OutputProcessor
from .scheduler import Request, ScheduledRow, Scheduler, Status, StepPlan
from .scheduler.scheduler import SeatManager
from .speculative.speculation import Speculation
from .stats import Counters, EngineStats, graph_count, runner_fields

PREFIX_COUNTERS = ("prefix_queried_tokens", "prefix_hit_tokens", "prefix_replayed_tokens", "prefix_evicted_blocks",
                   "prefix_snapshot_hits")


class Runner(Protocol):
    """What the core needs of a runner (runner/runner.ModelRunner is one)."""
    graph_replays: int               # CUDA-graph replays so far
    ran_rows: int                    # rows the last launched step ran (a graph's padded count)
    cuda_graphs: bool

    def execute(self, plan: StepPlan, prev, before_sample: Callable[[], set[str]] | None, ring_marks=None):
        """Launch the step; call before_sample between the forward and sampling. Returns its StepOutput
        (runner/runner.py: wait() until its tokens are on the host, resolve() them into lists)."""

    def graph_keys(self) -> list[tuple]:
        """The CUDA graphs captured so far."""

    def drop_graphs(self) -> None:
        """Forget the captured graphs: the model's modules changed under them."""

    def idle_step(self) -> None:
        """A step of one token on scratch: it computes nothing anyone reads, but meets every collective a step
        meets (a rank of an expert-parallel engine with nothing to run)."""


class StateCache(SeatManager, Protocol):
    """The scheduler's seat manager, and what it holds for the statistics (cache/manager.StateManager is one)."""

    def usage(self) -> dict:
        """EngineStats' state fields: num_seats, free_seats, num_blocks, free_blocks, block_tokens, state_bytes,
        state_summary, prefix_caching and the prefix counts (None where it keeps no such thing)."""

    def cache_blocks(self, rid: str, num_tokens: int, tokens: Callable[[int, int], list[int]]) -> None:
        """`rid`'s positions 0 .. num_tokens-1 are computed with committed tokens (prefix caching); `tokens(start,
        end)` gives those of [start, end), asked for only where a block is newly filled."""

    def interior_snapshots(self, rows, align: int | None) -> dict[int, list[tuple[int, int]]]:
        """Before a step's launch: slot -> [(position, seat)], the ring snapshots its prefill pieces take inside
        themselves (prefix caching; the runner's ring_marks)."""

    def keep_boundaries(self, rows, align: int | None) -> None:
        """After a step's launch: keep the rings of its rows that end at a block boundary (prefix caching)."""

    def forget_prefixes(self) -> None:
        """The model changed under the state: no cached prefix may be served again."""


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int                 # most sequences running at once (cut to the state manager's seats)
    max_num_batched_tokens: int       # positions fed per step
    max_model_len: int                # prompt + output positions per sequence
    async_scheduling: bool = True
    lockstep: bool = False            # every step() launches one forward, an idle one when nothing is planned (EP)


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
    def __init__(self, runner: Runner, manager: StateCache, kernels: KernelTable, config: EngineConfig,
                 decode: Callable[[list[int]], str], eos_token_id: int | None, speculation: Speculation | None = None,
                 traffic=None):
        """decode: output ids -> text (stop strings); speculation: speculative decoding's plan and apply (its
        runner verifies and drafts on the device); traffic: the model's parallel/traffic.ExpertTraffic counters,
        if it has them (reported in stats, zeroed by reset_stats)."""
        self.runner, self.manager, self.kernels, self.config = runner, manager, kernels, config
        self.traffic = traffic
        self.processor = OutputProcessor(decode, eos_token_id, config.max_model_len)
        align = invariant_chunk(config.max_num_batched_tokens) if kernels.invariant else None
        self.scheduler = Scheduler(min(config.max_num_seqs, manager.num_slots), config.max_num_batched_tokens,
                                   manager, config.max_model_len, align)
        self.speculation = speculation
        self.step_observers: list[Callable[[tuple[ScheduledRow, ...]], None]] = []   # each step's rows, pre-launch
        self._in_flight: tuple[StepPlan, object] | None = None   # the launched step not yet read (plan, StepOutput)
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
    def add_request(self, req: Request, num_computed: int = 0) -> None:
        """num_computed: positions of the prompt whose state the state manager already holds for the request
        (a context-parallel prefill); the scheduler plans the rest."""
        why = unsupported(req.params)
        if why is None and req.params.so_args is not None:
            if req.grammar is None:
                why = "so_args needs the request's grammar matcher (LLM.generate compiles it: engine/structured.py)"
            elif self.speculation is not None and self.speculation.pinned:
                why = ("so_args with a pinned speculative acceptance model: pinned acceptance ignores the tokens, "
                       "so it would commit drafts the grammar refuses; drop acceptance or so_args")
        if why is not None:
            raise DeepInferError(f"request {req.request_id}: {why}")
        if not 0 < req.num_tokens < self.max_model_len:
            raise DeepInferError(f"request {req.request_id} has {req.num_tokens} tokens; max_model_len is "
                                 f"{self.max_model_len}, which must leave room for at least one generated token")
        self.scheduler.add(req, num_computed)
        self._counters.requests_added += 1
        self._counters.prompt_tokens += len(req.prompt_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_all(self) -> list[Request]:
        """Stop every unfinished request (finish_reason "abort"): every seat and block goes back, nothing stays
        in flight. Returns them."""
        if self.speculation is not None:
            self.speculation.idle()            # the time to the next launch is no step's
        aborted = self.scheduler.abort_all()
        self._in_flight = None
        return aborted

    def output_text(self, req: Request) -> str:
        return self.processor.text(req)

    # ---- the loop ----
    def step(self) -> list[Request]:
        """One turn: (read the previous step first if the host needs its tokens to plan) -> plan and launch a step
        -> read the previous one. Returns the requests that finished in this turn."""
        finished: list[Request] = []
        with use(self.kernels):
            if self._in_flight is not None and (not self.async_scheduling or self.speculation is not None):
                finished += self._apply()
            t = time.perf_counter()
            plan = self._plan()
            self._counters.host_plan_s += time.perf_counter() - t
            launched = self._run(plan, finished) if plan.rows else None
            if launched is None and self.config.lockstep:
                self.runner.idle_step()
            if self._in_flight is not None:
                finished += self._apply()
            elif launched is None and self.scheduler.has_unfinished():
                raise DeepInferError("internal: the scheduler planned nothing with nothing in flight")
            if launched is not None:
                self._in_flight = launched
            if not self.scheduler.has_unfinished():   # what is still in flight belongs to finished requests: its
                if self.speculation is not None:      # tokens would be dropped; the device finishes it alone
                    self.speculation.idle()           # (and the time until the next request is not a step's)
                self._in_flight = None
        return finished

    def _plan(self) -> StepPlan:
        if not self.scheduler.has_unfinished():
            return StepPlan(())
        drafts = self.speculation.plan(self.scheduler.running) if self.speculation is not None else None
        return self.scheduler.schedule(drafts)

    @staticmethod
    def _samples_from_host(plan: StepPlan) -> bool:
        """A sampled row whose last token is in flight needs it on the host before it samples when it has a
        grammar (its mask needs the matcher advanced by that token). Penalty rows do not: the runner counts the
        token in flight into their output counts on the device."""
        return any(s.num_logits and s.num_in_flight and s.grammar is not None for s in plan.rows)

    def _run(self, plan: StepPlan, finished: list[Request]) -> tuple[StepPlan, object]:
        """Launch the step; when its sampling needs the previous step's tokens on the host, the previous step is
        read (into `finished`) after the forward is launched and before sampling, overlapping the forward. Its
        time, less that read's, counts as host_launch_s (on a CPU device the forward itself is in it)."""
        c = self._counters
        t, nested = time.perf_counter(), c.host_apply_s + c.device_wait_s
        for fn in self.step_observers:
            fn(plan.rows)

        def read_prev() -> set[str]:
            done = self._apply()
            finished.extend(done)
            return {r.request_id for r in done}
        prev = self._in_flight[1] if self._in_flight is not None else None
        captures = graph_count(self.runner) if self.speculation is not None else 0
        marks = self.manager.interior_snapshots(plan.rows, self.scheduler.chunk_align)
        out = self.runner.execute(plan, prev, read_prev if prev is not None and self._samples_from_host(plan)
                                  else None, marks)
        self.manager.keep_boundaries(plan.rows, self.scheduler.chunk_align)   # queued after this step's forward
        for row, entries in out.prompt_logprobs:
            self.processor.record_prompt_logprobs(row.request, entries)
        fed = plan.num_tokens
        c.steps += 1
        c.fed_tokens += fed
        c.draft_tokens += sum(len(s.draft_ids) for s in plan.rows)
        c.max_step_rows, c.max_step_tokens = max(c.max_step_rows, len(plan.rows)), max(c.max_step_tokens, fed)
        if self.speculation is not None:
            self.speculation.launched(self.runner.ran_rows, graph_count(self.runner) > captures)
        c.host_launch_s += time.perf_counter() - t - (c.host_apply_s + c.device_wait_s - nested)
        return plan, out

    def _apply(self) -> list[Request]:
        """The host side of the step in flight: commit each sampled row's tokens, finish requests (their seats go
        back), roll back rejected drafts. Time blocked until its tokens are on the host counts as device_wait_s
        (the device had not finished it), the rest, reading them into lists included, as host_apply_s."""
        plan, out = self._in_flight
        self._in_flight = None
        c = self._counters
        t = time.perf_counter()
        out.wait()
        read = time.perf_counter()
        c.device_wait_s += read - t
        results = out.resolve()
        for row in plan.rows:                         # prefill pieces (no sampled row): their blocks are computed
            if not row.num_logits and row.request.status is Status.RUNNING:
                self.manager.cache_blocks(row.request_id, row.start + row.n, row.request.tokens)
        accepted = self.speculation.apply(plan, out.speculation()) if self.speculation is not None else None
        now, finished = time.perf_counter(), []
        for i, (row, toks, lps) in enumerate(results):
            r = row.request
            self.scheduler.row_read(r)
            c.generated_tokens += len(toks)
            if r.status is Status.FINISHED:           # planned once more before its end was seen: dropped
                continue
            keep = toks[:accepted[i] + 1] if accepted is not None else toks
            kept = self.processor.commit(r, keep, lps[:len(keep)], now)
            c.committed_tokens += kept
            fed = len(row.draft_ids)
            if fed:                                   # a finish inside the commit drops the drafts after it
                took = min(len(keep) - 1, kept)
                c.accepted_draft_tokens += took
                _count_positions(c.drafts_at, fed)
                _count_positions(c.accepted_at, took)
            if row.n == row.num_logits:
                c.decode_rows += 1
                c.decode_row_tokens += kept
            if r.status is Status.RUNNING:            # its blocks this row completed join the prefix cache
                computed = row.start + row.n - fed + (took if fed else 0)
                self.manager.cache_blocks(r.request_id, computed, r.tokens)
            if r.finish_reason is not None:
                self.scheduler.finish(r)
                c.requests_finished += 1
                finished.append(r)
                continue
            if r.status is not Status.RUNNING:        # preempted meanwhile: recomputed from scratch anyway
                continue
            if len(keep) <= fed:                      # a draft was rejected: its position's state is stale
                self.scheduler.rollback(r, fed + 1 - len(keep))
                c.rollbacks += 1
        c.host_apply_s += time.perf_counter() - read
        return finished

    def modules_changed(self) -> None:
        """The model's modules were swapped (a rank view of expert parallelism opened or closed): the captured
        step graphs would replay the old ones, so they are dropped and each shape captures anew."""
        self.runner.drop_graphs()
        self.manager.forget_prefixes()

    # ---- statistics ----
    @property
    def stats(self) -> EngineStats:
        """A snapshot: counters since the engine was built or reset_stats(), and what it holds now."""
        runner = runner_fields(self.runner)
        runner["graph_replays"] -= self._base["graph_replays"]
        usage = self.manager.usage()
        for key in PREFIX_COUNTERS:                  # counted since the build: since reset_stats here
            if usage.get(key) is not None:
                usage[key] -= self._base.get(key) or 0
        return EngineStats(**dataclasses.asdict(self._counters),
                           preemptions=self.scheduler.num_preemptions - self._base["preemptions"],
                           kernel_backend=self.kernels.name, kernel_backends=dict(self.kernels.backends),
                           async_scheduling=self.async_scheduling, **runner, **usage,
                           expert_traffic=self.traffic.summary() if self.traffic is not None else None)

    def reset_stats(self) -> None:
        """Start the counters again (e.g. after a warm-up run)."""
        self._counters = Counters()
        if self.speculation is not None:
            self.speculation.reset_counts()
        if self.traffic is not None:
            self.traffic.reset()
        usage = self.manager.usage()
        self._base = {"preemptions": self.scheduler.num_preemptions,
                      "graph_replays": runner_fields(self.runner)["graph_replays"],
                      **{k: usage.get(k) for k in PREFIX_COUNTERS}}


def _count_positions(counts: list, n: int) -> None:
    """counts[k] += 1 for k < n (growing the list as needed)."""
    counts.extend([0] * (n - len(counts)))
    for k in range(n):
        counts[k] += 1
