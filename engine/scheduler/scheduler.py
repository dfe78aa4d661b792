"""Continuous batching: FCFS admission, decode and chunked prefill under one token budget per step, and
preemption by recompute when the state pools run out of blocks.

Each step: running sequences first (in admission order; a row feeds every position of the request's stream
not yet planned: the rest of its prompt, its newest token, its draft tokens; cut to what the budget leaves),
then waiting sequences while seats, budget and blocks remain. A sequence's blocks are reserved before the step
that needs them; when none are free the most recently admitted sequences are preempted (slot and blocks freed,
back to the front of the queue, recomputed later from prompt + outputs). `num_computed` advances when a step
is planned: with asynchronous scheduling the next step is planned while this one runs, its sampled tokens
still in flight (Request.num_inflight).

Drafts (`Request.spec_token_ids`): a row that reaches the newest committed token also feeds the drafts that
fit (the rest are dropped) and samples every one of those positions (num_logits = drafts + 1, a verify row).
A request with drafts is never planned while a row of it is in flight: how many tokens that row commits is
not known yet, so the drafts' positions are not either.

`chunk_align` (batch-invariant mode): prefill chunks are the pieces [k*a, (k+1)*a) of a sequence's tokens,
never cut by what else shares the step (a piece that does not fit waits), so a sequence's computation does
not depend on its neighbours."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from .request import Request, Status


class SeatManager(Protocol):
    """What the scheduler needs of a state manager (engine/cache/manager.py's StateManager is one): a seat (slot)
    per running request and room for its positions."""
    num_slots: int

    def reserve(self, rid: str, num_tokens: int) -> bool:
        """Own a slot and the blocks for positions 0..num_tokens-1; False (nothing taken) when not free."""

    def release(self, rid: str) -> None:
        """Give its slot and blocks back (no-op when it holds none)."""

    def slot(self, rid: str) -> int: ...


@dataclass(eq=False)
class Scheduled:
    req: Request
    start: int        # first position fed
    n: int            # tokens fed (positions start .. start+n-1)
    num_logits: int   # trailing fed positions whose next token is sampled: 0 (a prefill piece short of the end),
                      # 1 (reaches the end), q+1 (a verify row: the last token plus q drafts)

    @property
    def sample(self) -> bool:
        return self.num_logits > 0


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, manager: SeatManager, max_model_len: int,
                 chunk_align: int | None = None):
        self.max_num_seqs, self.max_tokens, self.manager = max_num_seqs, max_num_batched_tokens, manager
        self.max_model_len, self.chunk_align = max_model_len, chunk_align
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Scheduled]:
        budget, out = self.max_tokens, []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING or self._done_in_flight(req) or \
                    (req.spec_token_ids and req.num_inflight):
                continue
            n = self._chunk(req, budget)
            if n == 0:
                continue
            while not self.manager.reserve(req.request_id, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                out.append(self._plan(req, n))
                budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            n = self._chunk(req, budget) if req.num_inflight == 0 else 0
            if n == 0 or not self.manager.reserve(req.request_id, n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            out.append(self._plan(req, n))
            budget -= n
        return out

    def finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        req.spec_token_ids = []
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:          # preempted while its last token was in flight
            self.waiting.remove(req)
        self.manager.release(req.request_id)

    # ---- helpers ----
    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens to feed this step: all it has (known + in flight + usable drafts) not yet computed, within the
        budget."""
        self._trim_drafts(req)
        left = req.num_tokens + req.num_inflight + len(req.spec_token_ids) - req.num_computed
        if self.chunk_align is None:
            return min(left, budget)
        a = self.chunk_align
        n = min(left, a - req.num_computed % a)
        return n if n <= budget else 0

    def _trim_drafts(self, req: Request) -> None:
        """Drafts past max_model_len, or past what max_tokens lets a commit keep, are never fed."""
        if not req.spec_token_ids:
            return
        room = self.max_model_len - req.num_tokens                    # positions num_tokens.. still allowed
        if req.params.max_tokens is not None:                        # a commit of q+1 tokens must fit max_tokens
            room = min(room, req.params.max_tokens - len(req.output_ids) - 1)
        del req.spec_token_ids[max(room, 0):]

    def _done_in_flight(self, req: Request) -> bool:
        """Its in-flight token already ends it by length: nothing more to plan."""
        p = req.params
        n_out = len(req.output_ids) + req.num_inflight
        return req.num_inflight > 0 and ((p.max_tokens is not None and n_out >= p.max_tokens)
                                         or req.num_tokens + req.num_inflight >= self.max_model_len)

    def _plan(self, req: Request, n: int) -> Scheduled:
        """Advance num_computed by n; a row that covers the newest known token samples it and every draft it
        feeds (drafts it leaves out are dropped)."""
        start = req.num_computed
        req.num_computed += n
        known = req.num_tokens + req.num_inflight
        if req.num_computed < known:
            return Scheduled(req, start, n, 0)
        del req.spec_token_ids[req.num_computed - known:]
        return Scheduled(req, start, n, 1 + len(req.spec_token_ids))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.manager.release(req.request_id)
        req.status, req.num_computed = Status.WAITING, 0
        req.spec_token_ids = []            # proposed for a state that is gone; the drafter proposes again later
        self.waiting.appendleft(req)
        self.num_preemptions += 1
