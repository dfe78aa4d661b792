"""How many of its drafts each request verifies in the next step (the engine core asks before it plans a step).

    fixed       every draft (up to num_speculative_tokens): the comparison mode
    confidence  Algorithm 1 (spec/schedule.py schedule_greedy): admit drafts by prefix survival while
                expected accepted tokens x steps per second improves, stop at the first non-improvement
    budget      the production variant: the step's draft budget K from the confidences of the block before
                (known two steps back, so an asynchronous scheduler could fix the batch size early), then the
                top K drafts by live survival
The step rate SPS(B) comes from `step_seconds` in the config or is profiled when the engine starts
(ModelRunner.profile_step_seconds)."""

from __future__ import annotations

from .config import SpecConfig
from .schedule import StepRate, budget_from, schedule_budget, schedule_fixed, schedule_greedy


class VerifyPolicy:
    def __init__(self, config: SpecConfig, rate: StepRate | None):
        self.config, self.rate = config, rate
        self.steps = 0                 # planned steps that verified drafts
        self.verified = 0              # drafts those steps verified

    def choose(self, requests) -> None:
        """Trim each request's drafts (Request.spec_token_ids) to its verify length for the next step."""
        reqs = [r for r in requests if r.spec_token_ids]
        if not reqs:
            return
        conf = [r.spec_confidence[:len(r.spec_token_ids)] for r in reqs]
        mode = self.config.schedule
        if mode == "fixed":
            lengths = schedule_fixed(conf, self.config.num_speculative_tokens)
        elif mode == "confidence":
            lengths = schedule_greedy(conf, self.rate)
        else:
            stale = [r.spec_confidence_before[:len(c)] or c for r, c in zip(reqs, conf)]
            lengths = schedule_budget(conf, budget_from(stale, self.rate))
        for r, n in zip(reqs, lengths):
            del r.spec_token_ids[n:]
        self.steps += 1
        self.verified += sum(lengths)
