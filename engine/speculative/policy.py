"""How many of its drafts each request verifies in the next step (Speculation.plan asks before a step is planned).

    fixed       every draft (up to num_speculative_tokens): the comparison mode
    confidence  Algorithm 1 (speculative/schedule.py schedule_greedy): admit drafts by prefix survival while
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
StepRate per profiled context and segment count (speculative/step_rate.StepRateTable): each step is scheduled by the
table at the mean context of the requests it verifies (positions their state holds) and at their number, and
calibrated against the table at the shape it ran at.

Where verify steps run as CUDA graphs, a step of B rows runs as its graph's padded row count (pad: the runner's
StepGraphs.padded_rows; the profile measures the table at those counts). Rows the graph runs anyway cost nothing
more, so after the schedule the padding is filled with the next drafts in the ranked order (schedule.fill). That
keeps Algorithm 1 lossless: the fill's size follows from the drafts up to the early stop, and a draft's place in
the order never depends on a later draft of its own request. Algorithm 1 itself runs over the table's smooth curve
through the padded points: on the jagged one (flat inside a rung, a jump at its top) its early stop would halt at
the first draft past a rung's top. The budget rule takes its global argmax over the jagged curve (the cost of
pad(B)), as the paper's production variant does. A step with a request that has no drafts (a prefill piece, a
request's first decode) may run eagerly: it is not filled. Every schedule admits at most the drafts the step's token
budget (max_num_batched_tokens, less one row per running request) leaves room for: a cap on how many are admitted
in the ranked order, lossless like the early stop; left to the scheduler, a verify row would be cut by what the
rows before it in running order took, which depends on the row's own later drafts.
The policy also keeps the launch-to-launch seconds of the steps it measured by shape (segments, the rows the runner
ran), for the bench to hold against the table (step_times)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence

from .config import SpeculativeConfig
from .schedule import (batch_tokens, budget_from, fill, ranked_drafts, schedule_budget, schedule_fixed,
                       schedule_greedy)
from .step_rate import StepRate, StepRateTable


OVERHEAD_EMA = 0.8                     # weight of the previous estimate of the per-step overhead
OBSERVED_PER_SHAPE = 512               # measured steps kept per (segments, rows) shape


class VerifyPolicy:
    def __init__(self, config: SpeculativeConfig, rate: StepRate | StepRateTable | None, calibrate: bool = False,
                 pad: Callable[[int, int], int] | None = None, max_tokens: int | None = None):
        """rate: the step-rate table (one StepRate: at every context and segment count); calibrate: follow the per-step
        overhead beyond the table (for a profiled table); pad(segments, rows): the rows a verify step of that shape
        runs as (None: as many as it has); max_tokens: the scheduler's token budget a step (max_num_batched_tokens),
        which the verify lengths stay within."""
        self.config = config
        self.table = StepRateTable(flat=rate) if isinstance(rate, StepRate) else rate
        self.calibrate = calibrate and rate is not None
        self.pad = pad
        self.max_tokens = max_tokens
        self.filled = 0                # drafts admitted into graph padding
        # (segments, padded rows) -> [(measured seconds launch to launch, the table's seconds at that shape)]
        self.observed: dict[tuple[int, int], list[tuple[float, float | None]]] = {}
        self.overhead = 0.0            # seconds per step added to the table
        self.context = 0.0             # mean positions held by the requests of the last scheduled step
        self.segments = 1              # and how many of them verified drafts
        self.steps = 0                 # planned steps that verified drafts
        self.verified = 0              # drafts those steps verified
        self._last: tuple | None = None  # (when the previous step was launched, its padded rows, context, segments)

    @property
    def rate(self) -> StepRate | None:
        """The step rate the next step is scheduled by: the table at its context and segments, plus the overhead."""
        if self.table is None:
            return None
        rate = self.table.at(self.context, self.segments)
        return rate.with_offset(self.overhead) if self.calibrate else rate

    def launched(self, rows: int, captured: bool = False) -> None:
        """A step of `rows` rows was just launched (the engine core calls this each step, with the rows the runner
        ran: a graph's padded count, else the fed positions); captured: it captured a CUDA graph on the way (a
        one-off cost that is no step's overhead: that interval is skipped)."""
        now = time.perf_counter()
        if self._last is not None and not captured and self._last[3] > 0:
            when, ran, context, segments = self._last
            table = self.table.at(context, segments) if self.table is not None else None
            seen = self.observed.setdefault((segments, ran), [])
            if len(seen) < OBSERVED_PER_SHAPE:
                seen.append((now - when, None if table is None else table.seconds(ran)))
            if self.calibrate and ran <= table.tokens[-1]:
                excess = max(0.0, now - when - table.seconds(ran))
                self.overhead = OVERHEAD_EMA * self.overhead + (1 - OVERHEAD_EMA) * excess
        self._last = (now, rows, self.context, self.segments)

    def reset_counts(self) -> None:
        """Start the counters and the measured step times again (the engine core's reset_stats)."""
        self.steps = self.verified = self.filled = 0
        self.observed = {}
        self._last = None

    def step_times(self, min_steps: int = 3) -> list[dict]:
        """Per step shape measured at least min_steps times: segments, the rows the step ran (a graph's padded
        count), steps, the median measured milliseconds launch to launch and the median of the table's (without the
        calibrated overhead)."""
        out = []
        for (segments, rows), seen in sorted(self.observed.items()):
            if len(seen) >= min_steps:
                table = [t for _, t in seen if t is not None]
                out.append({"segments": segments, "rows": rows, "steps": len(seen),
                            "measured_ms": 1e3 * statistics.median(m for m, _ in seen),
                            "table_ms": 1e3 * statistics.median(table) if table else None})
        return out

    def idle(self) -> None:
        """Nothing is left to run: the wait for the next request is no step's overhead."""
        self._last = None

    def choose(self, running: Sequence, drafts: Mapping) -> None:
        """Trim each running request's drafts (drafts[request].token_ids) to its verify length for the next step."""
        reqs = [r for r in running if r in drafts and drafts[r].token_ids]
        if not reqs:
            self.segments = 0          # a step that verifies nothing: not measured, not calibrated against
            return
        proposed = [drafts[r] for r in reqs]
        conf = [d.confidence[:len(d.token_ids)] for d in proposed]
        self.context, self.segments = sum(r.num_computed for r in reqs) / len(reqs), len(reqs)
        mode = self.config.schedule
        pad = self.pad if len(reqs) == len(running) else None        # else the step may run eagerly: no padding
        ranked = ranked_drafts(conf) if mode != "fixed" else None     # once for the schedule and the fill
        # drafts the token budget leaves room for: a cap on the count admitted in the ranked order (lossless, as the
        # early stop), so the scheduler never cuts a verify row by what the rows before it took
        room = None if self.max_tokens is None else max(self.max_tokens - len(running), 0)
        if mode == "fixed":
            lengths = schedule_fixed(conf, self.config.num_speculative_tokens)
        elif mode == "confidence":
            lengths = schedule_greedy(conf, self.rate, ranked, room)
        else:
            stale = [d.confidence_before[:len(c)] or c for d, c in zip(proposed, conf)]
            rate = self.rate
            jagged = rate if pad is None else lambda b: rate(pad(len(reqs), b))   # noqa: E731
            lengths = schedule_budget(conf, budget_from(stale, jagged, room), ranked)
        if pad is not None and mode != "fixed":
            b = batch_tokens(lengths)
            extra = pad(len(reqs), b) - b
            if room is not None:
                extra = min(extra, room - (b - len(reqs)))
            lengths, added = fill(conf, lengths, extra, ranked)
            self.filled += added
        for d, n in zip(proposed, lengths):
            del d.token_ids[n:]
        self.steps += 1
        self.verified += sum(lengths)
