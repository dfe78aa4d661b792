"""Speculative decoding as the engine core sees it: one object, called at two points of each step around the
runner's own part.

    plan(running) -> {request: drafts}   before the scheduler plans the step: each request's drafts cut to the
                                         prefix its grammar allows, to the verify policy's length, and to what
                                         the request may still commit (max_tokens, max_model_len)
    (the runner verifies the step's verify rows and drafts the next block on the device: runner/speculate.py)
    apply(plan, verdicts) -> accepted    after the step is read: per sampled row, how many of its drafts were
                                         accepted (the row commits its first accepted + 1 sampled tokens, the
                                         one commit rule), and the drafts the runner proposed become each
                                         request's drafts for its next step

Drafts live here, per request (keyed by the Request), never on the Request: the scheduler gets them in plan()'s
answer and freezes the ones it feeds into the step plan. Drafts a step did not feed (the budget ran out before
the request's row) wait for the next step; a sampled row consumes its request's drafts; a preemption drops them
(they were proposed for a state that is gone), keeping the confidences the budget rule reads two steps back.

Speculation runs the synchronous loop (the core reads each step before it plans the next): a verify row commits
1..q+1 tokens, so the positions after it are not known before it is read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..scheduler import Request, Status, StepPlan
from .config import SpeculativeConfig
from .policy import VerifyPolicy


@dataclass
class Drafts:
    """One request's drafting state."""
    token_ids: list[int]                    # drafts for positions num_tokens.. (cut as plan() trims them)
    confidence: list[float]                 # the drafter's confidence in each, as proposed (not cut)
    confidence_before: list[float] = field(default_factory=list)   # the block before's (the budget rule's)


class Speculation:
    def __init__(self, policy: VerifyPolicy | None, max_model_len: int):
        """policy: the verify-length rule (None: every draft is verified as proposed)."""
        self.policy, self.max_model_len = policy, max_model_len
        self.drafts: dict[Request, Drafts] = {}

    @classmethod
    def build(cls, config: SpeculativeConfig, rate, graphs, max_tokens: int, max_model_len: int) -> "Speculation":
        """An engine's speculation: the verify policy over `rate` (runner/rate_profile.step_rate_table), padding
        verify steps to the rows of the runner's graphs (None: eager), its verify lengths within max_tokens (the
        step budget); a profiled table is calibrated online."""
        pad = graphs.padded_rows if graphs is not None else None
        policy = VerifyPolicy(config, rate, calibrate=config.varlen and not config.step_seconds, pad=pad,
                              max_tokens=max_tokens)
        return cls(policy, max_model_len)

    @property
    def pinned(self) -> bool:
        """Acceptance follows a pinned model (benchmarks), whatever the tokens."""
        return self.policy is not None and self.policy.config.acceptance is not None

    def plan(self, running: Sequence[Request]) -> dict[Request, tuple[int, ...]]:
        """The drafts each running request verifies in the next step (requests without drafts left out)."""
        self.drafts = {r: d for r, d in self.drafts.items() if r.status is not Status.FINISHED}
        for r in running:
            d = self.drafts.get(r)
            if d is not None and d.token_ids and r.grammar is not None:
                # a draft the grammar refuses can never be accepted (its masked probability is 0): verifying it
                # and the drafts after it would be wasted rows. The drafters draw unconstrained: masking a draft
                # block would need the step's committed tokens on the host before the block runs.
                del d.token_ids[r.grammar.legal_prefix(d.token_ids):]
        if self.policy is not None:
            self.policy.choose(running, self.drafts)
        out = {}
        for r in running:
            d = self.drafts.get(r)
            if d is not None and d.token_ids:
                fit = d.token_ids[:self._room(r)]
                if fit:
                    out[r] = tuple(fit)
        return out

    def apply(self, plan: StepPlan, verdicts: list[tuple[int, list[int], list[float]]] | None) -> list[int]:
        """The step `plan` was read: verdicts (the runner's, per sampled row: drafts accepted, the next drafts,
        their confidences; None when the runner drafts nothing) -> drafts accepted per sampled row."""
        for r in plan.preempted:
            if r in self.drafts:
                self.drafts[r].token_ids = []
        sampled = plan.sampled
        for row in plan.rows:
            d = self.drafts.get(row.request)
            if d is not None:
                if row.num_logits:
                    d.token_ids = []                     # consumed by the row (fed, or dropped by the budget)
                else:
                    del d.token_ids[self._room(row.request):]
        if verdicts is None:
            if any(row.draft_ids for row in sampled):
                raise RuntimeError("internal: a verify row was run by a runner that verifies no drafts")
            return [0] * len(sampled)
        for row, (_, proposed, confidence) in zip(sampled, verdicts, strict=True):
            before = self.drafts.get(row.request)
            self.drafts[row.request] = Drafts(list(proposed), list(confidence),
                                              before.confidence if before is not None else [])
        return [accepted for accepted, _, _ in verdicts]

    def launched(self, rows: int, captured: bool) -> None:
        """A step of `rows` rows was launched (the policy measures steps and calibrates its table)."""
        if self.policy is not None:
            self.policy.launched(rows, captured)

    def idle(self) -> None:
        """Nothing is left to run (or every request was aborted): no drafts are kept, and the wait for the next
        request is no step's time."""
        self.drafts = {}
        if self.policy is not None:
            self.policy.idle()

    def reset_counts(self) -> None:
        if self.policy is not None:
            self.policy.reset_counts()

    def _room(self, r: Request) -> int:
        """Drafts the request may feed: none past max_model_len, none past what max_tokens lets a commit keep."""
        room = self.max_model_len - r.num_tokens                      # positions num_tokens.. still allowed
        if r.params.max_tokens is not None:                          # a commit of q+1 tokens must fit max_tokens
            room = min(room, r.params.max_tokens - len(r.output_ids) - 1)
        return max(room, 0)
