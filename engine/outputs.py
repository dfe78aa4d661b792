"""What LLM.generate returns, vLLM-shaped: RequestOutput -> CompletionOutput(s) + metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)    # one per generated token
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability, as vLLM's `Logprob`: the raw model log-softmax value, the token's rank in that
    distribution (1 = most likely; 1 + the number of strictly more likely tokens) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None             # None when the engine has no tokenizer (skip_tokenizer_init)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None     # per generated token: {id: Logprob} (sampled id + top-k)
    finish_reason: str | None                     # "stop" | "length" | None while running
    stop_reason: int | str | None = None          # the stop token id or stop string that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None   # per prompt token (the first: None)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: list[RequestMetrics]                 # one per completion (each sample is its own sequence)
