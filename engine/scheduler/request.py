"""One sequence being generated: its tokens, its sampling settings, its model state and its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..outputs import RequestMetrics
from ..sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A sequence (one of the n samples of a prompt). `all_ids` = prompt + generated tokens the host has seen;
    `num_computed` of them are planned into steps (after a preemption that restarts at 0: recompute)."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                        # the seed its draws use: params.seed (+ sample index) or drawn when generate() creates it
    index: int = 0                   # which of the n samples
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0            # positions planned into steps (advanced when a step is planned)
    num_inflight: int = 0            # sampled tokens of planned steps not yet seen by the host
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_at: int | None = None       # where the matched stop string starts in the output text
    stop_checked: int = 0            # output text length already scanned for stop strings
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """Token i of prompt + outputs, without building the whole list."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens start .. end-1 of prompt + outputs."""
        n = len(self.prompt_ids)
        return self.prompt_ids[start:min(end, n)] + self.output_ids[max(start - n, 0):max(end - n, 0)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

