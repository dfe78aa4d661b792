"""How many of its drafts each request verifies in the next step (the engine core asks before it plans a step).

    fixed       every draft (up to num_speculative_tokens): the comparison mode
    confidence  Algorithm 1 (spec/schedule.py schedule_greedy): admit drafts by prefix survival while
                expected accepted tokens x steps per second improves, stop at the first non-improvement
    budget      the production variant: the step's draft budget K from the confidences of the block before
                (known two steps back, so an asynchronous scheduler could fix the batch size early), then the
                top K drafts by live survival
The step rate SPS(B) comes from `step_seconds` in the config, taken as given, or is profiled when the engine
starts (runner/rate_profile.profile_step_rates: the target step and the draft block on the device). A profiled table is
then calibrated online: what a whole engine step really takes beyond the table (host planning, sampling inputs,
commits: a cost per step that does not grow with the verified tokens) is followed as an exponential moving
average of (seconds between two launches - table seconds of the first one's tokens; an interval in which a CUDA
graph was captured is skipped), and added to every point.
Without it the schedule sees extra tokens as dearer than they are and trims too much. A profiled table has one
StepRate per profiled context and segment count (spec/step_rate.StepRateTable): each step is scheduled by the
table at the mean context of the requests it verifies (positions their state holds) and at their number, and
calibrated against the table at the shape it ran at."""

from __future__ import annotations

import time

from .config import SpecConfig
from .schedule import budget_from, schedule_budget, schedule_fixed, schedule_greedy
from .step_rate import StepRate, StepRateTable


OVERHEAD_EMA = 0.8                     # weight of the previous estimate of the per-step overhead


class VerifyPolicy:
    def __init__(self, config: SpecConfig, rate: StepRate | StepRateTable | None, calibrate: bool = False):
        """rate: the step-rate table (one StepRate: at every context and segment count); calibrate: follow the per-step
        overhead beyond the table (for a profiled table)."""
        self.config = config
        self.table = StepRateTable(flat=rate) if isinstance(rate, StepRate) else rate
        self.calibrate = calibrate and rate is not None
        self.overhead = 0.0            # seconds per step added to the table
        self.context = 0.0             # mean positions held by the requests of the last scheduled step
        self.segments = 1              # and how many of them verified drafts
        self.steps = 0                 # planned steps that verified drafts
        self.verified = 0              # drafts those steps verified
        self._last: tuple | None = None  # (when the previous step was launched, its tokens, context, segments)

    @property
    def rate(self) -> StepRate | None:
        """The step rate the next step is scheduled by: the table at its context and segments, plus the overhead."""
        if self.table is None:
            return None
        rate = self.table.at(self.context, self.segments)
        return rate.with_offset(self.overhead) if self.calibrate else rate

    def launched(self, tokens: int, captured: bool = False) -> None:
        """A step of `tokens` fed positions was just launched (the engine core calls this each step); captured: it
        captured a CUDA graph on the way (a one-off cost that is no step's overhead: that interval is skipped)."""
        now = time.perf_counter()
        if self.calibrate and self._last is not None and not captured:
            when, fed, context, segments = self._last
            table = self.table.at(context, segments)
            if fed <= table.tokens[-1]:
                excess = max(0.0, now - when - table.seconds(fed))
                self.overhead = OVERHEAD_EMA * self.overhead + (1 - OVERHEAD_EMA) * excess
        self._last = (now, tokens, self.context, self.segments)

    def idle(self) -> None:
        """Nothing is left to run: the wait for the next request is no step's overhead."""
        self._last = None

    def choose(self, requests) -> None:
        """Trim each request's drafts (Request.spec_token_ids) to its verify length for the next step."""
        reqs = [r for r in requests if r.spec_token_ids]
        if not reqs:
            return
        conf = [r.spec_confidence[:len(r.spec_token_ids)] for r in reqs]
        self.context, self.segments = sum(r.num_computed for r in reqs) / len(reqs), len(reqs)
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
