"""The step plan: what the scheduler decided for one step, frozen. The runner reads it (and nothing of a Request);
the engine core commits what the step returned to each row's request.

A row feeds positions start .. start+n-1 of one request's stream (prompt + committed outputs + the drafts
speculation gave it) and samples its last num_logits positions: 0 (a prefill piece short of the end), 1 (it
reaches the newest token) or q+1 (a verify row: the newest token and q drafts). The sampling inputs are
references to the request's own: its frozen SamplingParams, its prompt, and its output list, which the output
processor appends to; the runner reads that list only when it samples (penalty counts: the committed ids on the
host, plus the one output still in flight, if any, from the previous step's tokens on the device)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..sampling import SamplingParams
from .request import Request


@dataclass(frozen=True, slots=True, eq=False)
class ScheduledRow:
    request: Request                 # the request the row advances (the core commits to it; the runner never reads it)
    request_id: str
    slot: int                        # its state slot
    start: int                       # first position fed
    n: int                           # positions fed: start .. start+n-1
    num_logits: int                  # trailing fed positions whose next token is sampled: 0, 1 or q+1
    token_ids: tuple[int, ...]       # ids of the fed positions the host knows (committed, then drafts): n of them,
                                     # or n-1 when the last is the previous step's sample, still in flight
    draft_ids: tuple[int, ...]       # the drafts fed (a verify row's last num_logits-1 positions), else ()
    num_outputs: int                 # outputs before the first sampled position (committed + in flight)
    prompt_logprobs_done: int        # rows of this piece whose prompt logprobs the request already holds
    params: SamplingParams
    seed: int                        # the seed its draws use
    prompt_ids: list[int]            # the request's prompt (never written after the request is made)
    output_ids: list[int]            # the request's committed outputs (the output processor's list: read at sampling)
    grammar: Any                     # engine/structured.RequestGrammar (so_args), else None

    def __post_init__(self):
        if self.num_logits and len(self.draft_ids) != self.num_logits - 1:
            raise ValueError(f"a verify row of {len(self.draft_ids)} drafts samples {len(self.draft_ids) + 1} "
                             f"positions, got {self.num_logits}")

    @property
    def num_in_flight(self) -> int:
        """Fed positions whose token is still in flight (0 or 1)."""
        return self.n - len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """A fed position predicts a prompt token whose logprob was asked for."""
        return self.params.prompt_logprobs is not None and self.start + 1 < len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class StepPlan:
    rows: tuple[ScheduledRow, ...]           # in the order the step feeds them
    preempted: tuple[Request, ...] = ()      # requests preempted while planning it (recomputed later)

    @property
    def sampled(self) -> list[ScheduledRow]:
        return [r for r in self.rows if r.num_logits > 0]

    @property
    def num_tokens(self) -> int:
        return sum(r.n for r in self.rows)
