"""A step's inputs from its plan: the segments (slot, start, length), the flat token ids (in-flight ones read on
the device), and which rows need logits (sampled positions, prompt-logprob positions)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..outputs import Logprob
from ..sampling.sampler import logprobs
from ..scheduler.plan import ScheduledRow


# prompt-logprob rows whose logits exist at once (a 128k-token piece's fp32 logits over a 129k vocabulary would be
# 63 GiB; one block of 4096 rows is 2 GiB, its log-softmax as much again)
PROMPT_LOGPROB_ROWS = 4096


@dataclass
class StepInputs:
    rows: tuple[ScheduledRow, ...]
    slots: list[int]
    starts: list[int]
    lens: list[int]
    tokens: torch.Tensor             # [N] int64 on the device
    logit_rows: list[int]            # rows of the flat batch whose logits the step computes
    max_position: int
    uniform_q: int | None            # every segment is q rows, all sampled (a graph shape); else None
    all_sampled: bool = False        # every row is sampled, no prompt logprobs (a variable-length graph shape)

    @classmethod
    def build(cls, batch: tuple[ScheduledRow, ...], prev, device: torch.device) -> "StepInputs":
        slots, starts, lens, host, patch, logit_rows = [], [], [], [], [], []
        o = 0
        for s in batch:
            host += s.token_ids
            in_flight = s.num_in_flight
            if in_flight:
                if in_flight != 1 or prev is None:
                    raise RuntimeError(f"internal: request {s.request_id} feeds {in_flight} unknown tokens")
                patch.append((o + s.n - 1, prev.index[s.request_id]))
                host.append(0)
            slots.append(s.slot)
            starts.append(s.start)
            lens.append(s.n)
            first_logit = 0 if s.wants_prompt_logprobs else s.n - s.num_logits
            logit_rows += range(o + first_logit, o + s.n)
            o += s.n
        tokens = torch.tensor(host, dtype=torch.long).to(device, non_blocking=True)
        if patch:
            rows, src = (torch.tensor(v, dtype=torch.long).to(device, non_blocking=True) for v in zip(*patch))
            tokens[rows] = prev.tokens[src]
        sampled = bool(batch) and all(s.num_logits == n and not s.wants_prompt_logprobs for s, n in zip(batch, lens))
        return cls(batch, slots, starts, lens, tokens, logit_rows, max(a + n - 1 for a, n in zip(starts, lens)),
                   _uniform_q(lens) if sampled else None, sampled)

    @classmethod
    def shaped(cls, slots: list[int], starts: list[int], lens: list[int], tokens: torch.Tensor,
               logit_rows: list[int] | None = None) -> "StepInputs":
        """A step of a given shape with no plan behind it (ModelRunner.run_shape): segment g feeds lens[g] tokens
        to slot slots[g] from position starts[g]; logit_rows None: every row is sampled (a decode / verify shape,
        a CUDA graph where execute would replay one), else the rows that need logits (a prefill piece: its last
        row; a prompt-logprob piece: its rows)."""
        sampled = logit_rows is None
        return cls((), list(slots), list(starts), list(lens), tokens,
                   list(range(sum(lens))) if sampled else list(logit_rows),
                   max(a + n - 1 for a, n in zip(starts, lens)), _uniform_q(lens) if sampled else None, sampled)

    def needs(self) -> tuple[list[int], list[bool]]:
        """Per segment: how many trailing rows need logits, and whether rows before those do too (a
        prompt-logprob piece): what execute's truncation rule reads."""
        if self.rows:
            return ([s.num_logits for s in self.rows], [s.wants_prompt_logprobs for s in self.rows])
        if self.all_sampled:
            return list(self.lens), [False] * len(self.lens)
        wanted, o, trailing, before = set(self.logit_rows), 0, [], []
        for n in self.lens:
            k = sum(1 for r in range(o, o + n) if r in wanted)
            suffix = all(r in wanted for r in range(o + n - k, o + n))
            trailing.append(k if suffix else n)
            before.append(not suffix)
            o += n
        return trailing, before

    @property
    def sampled(self) -> list[ScheduledRow]:
        return [s for s in self.rows if s.num_logits > 0]

    def logit_rows_tensor(self) -> torch.Tensor:
        return torch.tensor(self.logit_rows, dtype=torch.long).to(self.tokens.device, non_blocking=True)

    def _segments_in_logits(self):
        """(scheduled, first row of its logits, number of its logit rows) in the logits tensor."""
        o = 0
        for s in self.rows:
            k = s.n if s.wants_prompt_logprobs else s.num_logits
            yield s, o, k
            o += k

    def prompt_logprob_rows(self):
        """(scheduled, slice of its rows in the logits tensor) for pieces that record prompt logprobs."""
        return [(s, slice(o, o + k)) for s, o, k in self._segments_in_logits() if s.wants_prompt_logprobs]

    def sample_rows_in_logits(self) -> torch.Tensor:
        """Rows of the logits tensor that are sampled: each sampled segment's trailing num_logits rows."""
        rows = [o + k - s.num_logits + j for s, o, k in self._segments_in_logits() for j in range(s.num_logits)]
        return torch.tensor(rows, dtype=torch.long).to(self.tokens.device, non_blocking=True)


def _uniform_q(lens: list[int]) -> int | None:
    """q when every segment of an all-sampled step is q rows (a uniform graph shape), else None."""
    return lens[0] if lens and all(n == lens[0] for n in lens) else None


def prompt_logprob_entries(s: ScheduledRow, logits: torch.Tensor, row0: int = 0) -> list[dict]:
    """Rows of prompt positions a..a+n-1 predict tokens a+1..a+n: log-softmax of each prompt token (+ top-k);
    the first prompt token has none (as vLLM). logits holds the piece's rows row0.. (the runner passes a piece in
    blocks of PROMPT_LOGPROB_ROWS); rows the request already holds (fed again after a preemption) are skipped.
    One device->host copy per call (not one per position)."""
    a = s.start
    first = max(s.prompt_logprobs_done, row0)
    last = min(s.n, len(s.prompt_ids) - a - 1, row0 + logits.shape[0])   # rows that predict a prompt token
    if last <= first:
        return []
    targets = s.prompt_ids[a + first + 1:a + last + 1]
    k = s.params.prompt_logprobs
    chosen, rank, top_ids, top_vals = (t.tolist() if t is not None else None for t in logprobs(
        logits[first - row0:last - row0], torch.tensor(targets, device=logits.device), k))
    return [logprob_entry(tok, chosen[i], rank[i], top_ids[i] if k else (), top_vals[i] if k else ())
            for i, tok in enumerate(targets)]


def logprob_entry(token: int, value: float, rank: int, top_ids, top_values) -> dict[int, Logprob]:
    """{token: Logprob} for a sampled (or prompt) token and the top-k tokens of the same distribution (ranks 1..k;
    a top-k token equal to `token` keeps the top-k entry, as vLLM). decoded_token is filled by LLM's output."""
    entry = {token: Logprob(value, rank)}
    entry.update((t, Logprob(v, j + 1)) for j, (t, v) in enumerate(zip(top_ids, top_values)))
    return entry
