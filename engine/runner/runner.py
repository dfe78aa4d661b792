"""Runs one planned step: prefill pieces through the reference forward (state loaded from and stored back to the
pools), decode rows through the paged decode step (a CUDA graph on GPU), then samples on the device.

Inputs are built once per step; a decode row whose input token is still in flight (asynchronous scheduling)
reads it on the device from the previous step's sampled tokens, so planning step N+1 never waits for step N.
`StepOutput.resolve()` is the one host synchronisation: it brings the sampled tokens (and logprobs) back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels.precision import upcast

from ..env import yoco_prefill, yoco_prefill_min_tokens
from ..sampling.sampler import build_sampling_tensors, logprobs, sample
from ..scheduler.scheduler import Scheduled
from .graphs import DecodeGraphs


def paged_decode_step(model):
    if model.cfg.model_type == "deepseek_v41":
        from ..models.paged_v41 import decode_step
    else:
        from ..models.paged_v4 import decode_step
    return decode_step


@dataclass
class StepOutput:
    """Sampled tokens of one step, still on the device until resolve()."""
    sampled: list[Scheduled]
    tokens: torch.Tensor | None                      # [M] on the device
    index: dict[str, int] = field(default_factory=dict)
    lp: tuple | None = None                          # (rows [R], chosen [R], top ids [R, k], top values [R, k])

    def resolve(self) -> list[tuple[Scheduled, list[int], list[dict | None]]]:
        """Per sampled row: its sampled tokens (one per logit position, in position order) and their logprob
        entries (None where not asked)."""
        if self.tokens is None:
            return []
        toks = self.tokens.tolist()
        entries: dict[int, dict] = {}
        if self.lp is not None:
            rows, chosen, ids, vals = (t.tolist() if t is not None else None for t in self.lp)
            for j, r in enumerate(rows):
                entry = {toks[r]: chosen[j]}
                k = self.sampled[r].req.params.logprobs
                if ids is not None and k:
                    entry.update(zip(ids[j][:k], vals[j][:k]))
                entries[r] = entry
        return [(s, [toks[i]], [entries.get(i)]) for i, s in enumerate(self.sampled)]


class ModelRunner:
    def __init__(self, model, manager, cuda_graphs: bool, max_graph_batch: int, fixed_context: bool = False):
        self.model, self.manager, self.pools = model, manager, manager.pools
        self.yoco = model.cfg.model_type == "deepseek_v41" and yoco_prefill()
        self.yoco_min_tokens = yoco_prefill_min_tokens()
        self.decode_step = paged_decode_step(model)
        self.fixed_context = fixed_context          # batch-invariant mode: every decode reads all block columns
        self.graphs = DecodeGraphs(self.decode_step, model, self.pools, max_graph_batch) \
            if cuda_graphs and model.device.type == "cuda" else None

    @torch.inference_mode()
    def execute(self, batch: list[Scheduled], prev: StepOutput | None) -> StepOutput:
        rows: dict[int, torch.Tensor] = {}                  # id(scheduled) -> logits of its last fed position
        decode = [s for s in batch if s.n == 1 and s.start > 0 and not _wants_prompt_logprob(s)]
        prefill = [s for s in batch if s not in decode]
        if prefill:
            self._prefill(prefill, rows)
        if decode:
            self._decode(decode, prev, rows)
        return self._sample([s for s in batch if s.sample], rows)

    # ---- prefill: the reference forward on states loaded from the pools ----
    def _prefill(self, batch: list[Scheduled], rows: dict) -> None:
        full = [s for s in batch if _wants_prompt_logprob(s) or not self.yoco or s.n < self.yoco_min_tokens]
        truncated = [s for s in batch if s not in full]
        for group, last_only in ((full, False), (truncated, True)):
            if not group:
                continue
            slots = [self.manager.slot(s.req.request_id) for s in group]
            states = [self.pools.load_state(slot, s.start, self.model.new_state()) for slot, s in zip(slots, group)]
            chunks = [torch.tensor(s.req.tokens(s.start, s.start + s.n)) for s in group]
            kwargs = {"last_only": True} if last_only else {}
            logits = self.model.extend(chunks, states, **kwargs)
            for slot, s, st, lg in zip(slots, group, states, logits):
                self.pools.store_state(slot, st, s.start)
                if _wants_prompt_logprob(s):
                    record_prompt_logprobs(s, lg)
                rows[id(s)] = lg[-1]

    # ---- decode: one token per row over the pools ----
    def _decode(self, batch: list[Scheduled], prev: StepOutput | None, rows: dict) -> None:
        dev = self.model.device
        host_tok, prev_idx = [], []
        for s in batch:
            known = s.start < s.req.num_tokens
            host_tok.append(s.req.token_at(s.start) if known else 0)
            prev_idx.append(-1 if known else prev.index[s.req.request_id])
        as_t = lambda v: torch.tensor(v, dtype=torch.long).to(dev, non_blocking=True)  # noqa: E731
        tokens = as_t(host_tok)
        if any(i >= 0 for i in prev_idx):
            idx = as_t(prev_idx)
            tokens = torch.where(idx >= 0, prev.tokens[idx.clamp(min=0)], tokens)
        slots = as_t([self.manager.slot(s.req.request_id) for s in batch])
        positions = as_t([s.start for s in batch])
        ctx = self._context_blocks(max(s.start for s in batch) + 1)
        logits = self.graphs.run(slots, positions, tokens, ctx) if self.graphs is not None else None
        if logits is None:
            logits = self.decode_step(self.model, self.pools, slots, positions, tokens, ctx)
        for i, s in enumerate(batch):
            rows[id(s)] = logits[i]

    def _context_blocks(self, num_tokens: int) -> int:
        """Block-table columns a decode reads: the longest row's blocks rounded up to a power of two (few graph
        shapes); all columns in batch-invariant mode (shapes independent of the batch)."""
        if self.fixed_context:
            return self.pools.max_blocks
        need = max(self.manager.layout.blocks_for(num_tokens), 1)
        return min(1 << (need - 1).bit_length(), self.pools.max_blocks)

    # ---- sampling ----
    def _sample(self, sampling: list[Scheduled], rows: dict) -> StepOutput:
        if not sampling:
            return StepOutput([], None)
        logits = torch.stack([rows[id(s)] for s in sampling])
        reqs = [s.req for s in sampling]
        t = build_sampling_tensors([r.params for r in reqs], [r.seed for r in reqs],
                                   [r.num_tokens + r.num_inflight for r in reqs], logits.shape[-1], logits.device,
                                   [r.prompt_ids for r in reqs], [r.output_ids for r in reqs],
                                   self.model.cfg.eos_token_id, [len(r.output_ids) + r.num_inflight for r in reqs])
        tokens = sample(logits, t)
        out = StepOutput(sampling, tokens, {s.req.request_id: i for i, s in enumerate(sampling)})
        want = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if want:
            k = max(reqs[i].params.logprobs for i in want)
            idx = torch.tensor(want, device=logits.device)
            chosen, ids, vals = logprobs(logits[idx], tokens[idx], k)
            out.lp = (idx, chosen, ids, vals)
        return out


def _wants_prompt_logprob(s: Scheduled) -> bool:
    """A fed position that predicts a prompt token whose logprob was asked for (only the prefill path records)."""
    return s.req.params.prompt_logprobs is not None and s.start + 1 < len(s.req.prompt_ids)


def record_prompt_logprobs(s: Scheduled, logits: torch.Tensor) -> None:
    """Rows of prompt positions a..a+n-1 predict tokens a+1..a+n: log-softmax of each prompt token (+ top-k);
    the first prompt token has none (as vLLM). One device->host copy per piece (not one per position)."""
    req, a = s.req, s.start
    if req.prompt_logprobs is None:
        req.prompt_logprobs = [None]
    first = max(len(req.prompt_logprobs) - a - 1, 0)   # rows already recorded before a preemption are skipped
    last = min(s.n, len(req.prompt_ids) - a - 1)       # rows that predict a prompt token
    if last <= first:
        return
    lp = torch.log_softmax(upcast(logits[first:last]), dim=-1)                     # [m, vocab]
    targets = req.prompt_ids[a + first + 1:a + last + 1]
    chosen = lp.gather(1, torch.tensor(targets, device=lp.device).view(-1, 1)).squeeze(1).tolist()
    k = req.params.prompt_logprobs
    top = lp.topk(k, dim=-1) if k else None
    top_ids, top_vals = (top.indices.tolist(), top.values.tolist()) if k else ([], [])
    for i, (tok, val) in enumerate(zip(targets, chosen)):
        entry = {tok: val}
        if k:
            entry.update(zip(top_ids[i], top_vals[i]))
        req.prompt_logprobs.append(entry)
