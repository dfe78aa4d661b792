"""Continuous batching: FCFS admission, decode and chunked prefill under one token budget per step, and
preemption by recompute when the sequences' state outgrows its memory budget.

Each step: running sequences first (in admission order; a decode feeds 1 token, a prefill the rest of its
known tokens, cut to what the budget leaves), then waiting sequences while seats and budget remain. After the
model ran, if the running sequences' state bytes exceed the budget, the most recently admitted ones are
preempted: their state is dropped and they go back to the front of the queue, to be recomputed from their
tokens (prompt + what they generated so far) when there is room. The budget is soft for a lone sequence
(it runs rather than never finishing)."""

from __future__ import annotations

from collections import deque

from .request import Request, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, state_budget_bytes: int | None, new_state):
        self.max_num_seqs, self.max_tokens, self.budget = max_num_seqs, max_num_batched_tokens, state_budget_bytes
        self.new_state = new_state
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """[(sequence, number of its next tokens to feed)] for one step."""
        budget, out = self.max_tokens, []
        for req in self.running:
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed, budget)
            out.append((req, n))
            budget -= n
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0 and not self._full():
            req = self.waiting.popleft()
            req.status, req.state = Status.RUNNING, self.new_state()
            self.running.append(req)
            n = min(req.num_tokens - req.num_computed, budget)
            out.append((req, n))
            budget -= n
        return out

    def finish(self, req: Request) -> None:
        req.status, req.state = Status.FINISHED, None
        self.running.remove(req)

    def enforce_budget(self) -> list[Request]:
        """Preempt (recompute later) the newest running sequences while the state is over budget."""
        preempted = []
        while self.budget is not None and len(self.running) > 1 and self._full():
            req = self.running.pop()
            req.status, req.state, req.num_computed = Status.WAITING, None, 0
            self.waiting.appendleft(req)
            preempted.append(req)
            self.num_preemptions += 1
        return preempted

    def state_bytes(self) -> int:
        return sum(r.state.nbytes() for r in self.running if r.state is not None)

    def _full(self) -> bool:
        return self.budget is not None and self.state_bytes() > self.budget
