"""Continuous batching: FCFS admission, decode and chunked prefill under one token budget per step, and
preemption by recompute when the state pools run out of blocks.

Each step: running sequences first (in admission order; a row feeds every position of the request's stream
not yet planned: the rest of its prompt, its newest token, its draft tokens; cut to what the budget leaves),
then waiting sequences while seats, budget and blocks remain. A sequence's blocks are reserved before the step
that needs them; when none are free the most recently admitted sequences are preempted (slot and blocks freed,
back to the front of the queue, recomputed later from prompt + outputs). A sequence that starts (or restarts)
with a cached prefix (prefix caching, cache/prefix.py) starts at its replay: num_computed = the hit minus the
replay length, vLLM's rule of counting a hit as computed, less what bounded replay recomputes (its first piece
ends at the hit, where the cache keeps the rings for the next request sharing it); prompt-logprob
requests never take a hit (they need every prompt position's logits). `num_computed` advances when a step
is planned: with asynchronous scheduling the next step is planned while this one runs, its sampled tokens
still in flight (Request.num_inflight).

Drafts (speculation's, given to `schedule`): a row that reaches the newest committed token also feeds the
drafts that fit the budget (the rest are dropped) and samples every one of those positions (num_logits =
drafts + 1, a verify row); the rings are snapshotted first where they have too little slack to roll back. A
request with drafts is never planned while a row of it is in flight: how many tokens that row commits is not
known yet, so the drafts' positions are not either.

The scheduler writes a Request's planning state (status, num_computed, num_inflight, rollbacks, aborts); the
output processor its outputs. The plan (scheduler/plan.py) is frozen: the runner reads no Request.

`chunk_align` (batch-invariant mode): prefill chunks are the pieces [k*a, (k+1)*a) of a sequence's tokens,
never cut by what else shares the step (a piece that does not fit waits), so a sequence's computation does
not depend on its neighbours."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from .plan import ScheduledRow, StepPlan
from .request import Request, Status


class SeatManager(Protocol):
    """What the scheduler needs of a state manager (engine/cache/manager.py's StateManager is one): a seat (slot)
    per running request and room for its positions."""
    num_slots: int

    def reserve(self, rid: str, num_tokens: int, hit=None) -> bool:
        """Own a slot and the blocks for positions 0..num_tokens-1 (the first ones `hit`'s shared blocks); False
        (nothing taken) when not free."""

    def release(self, rid: str) -> None:
        """Give its slot and blocks back (no-op when it holds none)."""

    def slot(self, rid: str) -> int: ...

    def match_prefix(self, rid: str, tokens: list[int], align: int | None = None):
        """A cached prefix (cache/prefix.PrefixHit: its positions, where its replay starts) a sequence about to start
        could share, or None (ring snapshots only at multiples of `align`); nothing is taken until reserve(rid, n,
        hit)."""

    def snapshot_unless_slack(self, rid: str, num_tokens: int, drafts: int) -> None:
        """Before a verify row of `drafts` drafts from position num_tokens: keep what a rollback must restore."""

    def restore(self, rid: str, num_tokens: int) -> int:
        """After a verify row rejected drafts: the state back to at most num_tokens positions; returns how many it
        holds."""


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, manager: SeatManager, max_model_len: int,
                 chunk_align: int | None = None):
        self.max_num_seqs, self.max_tokens, self.manager = max_num_seqs, max_num_batched_tokens, manager
        self.max_model_len, self.chunk_align = max_model_len, chunk_align
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request, num_computed: int = 0) -> None:
        """num_computed: positions whose state the request's seat already holds (a context-parallel prefill put it
        there, parallel/context_parallel.py); its first step feeds the rest. A preemption drops it as any state."""
        req.num_computed = num_computed
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, drafts: Mapping[Request, Sequence[int]] | None = None) -> StepPlan:
        """The next step's plan; drafts: each running request's drafts to verify (speculation's plan)."""
        drafts = dict(drafts or {})
        budget, rows, preempted, now = self.max_tokens, [], [], time.perf_counter()
        for req in list(self.running):
            if budget == 0:
                break
            fed = drafts.get(req, ())
            if req.status is not Status.RUNNING or self._done_in_flight(req) or (fed and req.num_inflight):
                continue
            n = self._chunk(req, budget, len(fed))
            if n == 0:
                continue
            while not self.manager.reserve(req.request_id, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                drafts.pop(victim, None)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                rows.append(self._plan(req, n, drafts.get(req, ()), now))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            if req.num_inflight or req in preempted:   # not back in the step that preempted it: a step in flight
                break                                  # may still hold rows of its old seat
            hit = self.manager.match_prefix(req.request_id, req.tokens(0, req.num_tokens), self.chunk_align) \
                if req.num_computed == 0 and req.params.prompt_logprobs is None else None
            start = req.num_computed
            if hit is not None:                  # the cached blocks hold [0, hit.tokens); the replay starts before
                a = self.chunk_align             # (on the piece grid: the full prefill's pieces from there on)
                if a is not None:
                    hit = dataclasses.replace(hit, replay_start=hit.replay_start // a * a)
                req.num_computed = hit.replay_start
            n = self._chunk(req, budget, 0)
            if hit is not None and self.chunk_align is None and req.num_computed < hit.tokens:
                n = min(n, hit.tokens - req.num_computed)    # the replay's piece ends at the hit: its rings are
                #                                              snapshotted there for the next request sharing it
            if n == 0 or not self.manager.reserve(req.request_id, req.num_computed + n, hit):
                req.num_computed = start
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append(self._plan(req, n, (), now))
            budget -= n
        return StepPlan(tuple(rows), tuple(preempted))

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:          # preempted while its last token was in flight
            self.waiting.remove(req)
        self.manager.release(req.request_id)

    def abort_all(self) -> list[Request]:
        """Finish every unfinished request with finish_reason "abort" (seats and blocks go back); returns them."""
        aborted = list(self.running) + list(self.waiting)
        for req in aborted:
            req.finish_reason = "abort"
            self.finish(req)
        return aborted

    def row_read(self, req: Request) -> None:
        """The host has read a sampled row of `req` (it is no longer in flight)."""
        req.num_inflight -= 1

    def rollback(self, req: Request, num_rejected: int) -> None:
        """A verify row rejected drafts: the positions after the last accepted one are planned again. The cache
        restores what it can; when its state holds fewer positions (a snapshot from before the verify row), the
        positions after it are planned again too."""
        req.num_computed -= num_rejected
        kept = self.manager.restore(req.request_id, req.num_computed)
        if kept < req.num_computed:
            req.num_computed = kept

    # ---- helpers ----
    def _chunk(self, req: Request, budget: int, num_drafts: int) -> int:
        """Tokens to feed this step: all it has (known + in flight + drafts) not yet computed, within the budget."""
        left = req.num_tokens + req.num_inflight + num_drafts - req.num_computed
        if self.chunk_align is None:
            return min(left, budget)
        a = self.chunk_align
        n = min(left, a - req.num_computed % a)
        return n if n <= budget else 0

    def _done_in_flight(self, req: Request) -> bool:
        """Its in-flight token already ends it by length: nothing more to plan."""
        p = req.params
        n_out = len(req.output_ids) + req.num_inflight
        return req.num_inflight > 0 and ((p.max_tokens is not None and n_out >= p.max_tokens)
                                         or req.num_tokens + req.num_inflight >= self.max_model_len)

    def _plan(self, req: Request, n: int, drafts: Sequence[int], now: float) -> ScheduledRow:
        """Advance num_computed by n; a row that covers the newest known token samples it and every draft it
        feeds (drafts it leaves out are dropped)."""
        start = req.num_computed
        req.num_computed += n
        req.metrics.first_scheduled_time = req.metrics.first_scheduled_time or now
        known = req.num_tokens + req.num_inflight
        fed = tuple(drafts[:req.num_computed - known]) if req.num_computed >= known else ()
        num_logits = 1 + len(fed) if req.num_computed >= known else 0
        num_outputs = len(req.output_ids) + req.num_inflight
        if fed:
            self.manager.snapshot_unless_slack(req.request_id, start, len(fed))
        if num_logits:
            req.num_inflight += 1
        recorded = len(req.prompt_logprobs) if req.prompt_logprobs is not None else 1
        return ScheduledRow(req, req.request_id, self.manager.slot(req.request_id), start, n, num_logits,
                            tuple(req.tokens(start, start + n, fed)), fed, num_outputs,
                            min(max(recorded - start - 1, 0), n), req.params, req.seed, req.prompt_ids,
                            req.output_ids, req.grammar)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.manager.release(req.request_id)
        req.status, req.num_computed = Status.WAITING, 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1
