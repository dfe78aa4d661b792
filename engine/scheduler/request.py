"""One sequence being generated: its tokens, its sampling settings, its model state and its timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from ..outputs import RequestMetrics
from ..sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A sequence (one of the n samples of a prompt): prompt + committed outputs, `num_computed` positions of which
    are planned into steps (after a preemption that restarts at 0: recompute; after a verify row that rejected
    drafts it rolls back to the positions whose state stays valid). Its draft tokens are speculation's
    (engine/speculative/speculation.py), fed through the step plan. Only the scheduler (planning state) and the
    output processor (outputs, finish) write its fields."""
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                        # the seed its draws use: params.seed (+ sample index) or drawn when generate() creates it
    index: int = 0                   # which of the n samples
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0            # positions planned into steps (advanced when a step is planned)
    num_inflight: int = 0            # sampled rows of planned steps not yet seen by the host (each commits >= 1)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_at: int | None = None       # where the matched stop string starts in the output text
    stop_checked: int = 0            # output text length already scanned for stop strings
    detok_tokens: int = 0            # output ids whose text is final (output_processor: incremental decoding)
    detok_text: str = ""             # that text
    logprobs: list[dict] | None = None           # per committed token: {id: Logprob}
    prompt_logprobs: list[dict | None] | None = None
    grammar: Any = None              # engine/structured.RequestGrammar when params.so_args is set (LLM makes it)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    def tokens(self, start: int, end: int, drafts=()) -> list[int]:
        """Tokens start .. end-1 of the stream prompt + outputs + `drafts` (proposed for positions num_tokens..)."""
        n, m = len(self.prompt_ids), self.num_tokens
        return (self.prompt_ids[start:min(end, n)] + self.output_ids[max(start - n, 0):max(end - n, 0)]
                + list(drafts[max(start - m, 0):max(end - m, 0)]))

    @property
    def num_tokens(self) -> int:
        """Prompt + committed outputs (drafts not included)."""
        return len(self.prompt_ids) + len(self.output_ids)

