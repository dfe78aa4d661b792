"""Runs one planned step: every row (prefill pieces, decode rows, verify rows) through the model's one forward
over the state pools, then samples on the device.

Inputs are built once per step (runner/inputs.py). A step whose rows are all sampled (decode rows, verify rows
of one length or of many) replays a CUDA graph of that shape on GPU (runner/graphs.py); everything else runs
eagerly with compact per-step lists. A row whose input token is still in flight
(asynchronous scheduling) reads it on the device from the previous step's sampled tokens, so planning step
N+1 never waits for step N. Sampling reads host state last: `execute(..., before_sample)` calls before_sample
once the forward is launched and before the sampler's inputs are built, so the engine can read the previous
step (advance grammar matchers) while the device runs this step's forward; a penalty row counts its token in
flight on the device (the previous step's sample, as the input token above), so it needs no host read. The
sampled tokens (and logprobs) start back to pinned host memory as soon as they are drawn; `StepOutput.resolve()`
is the one host synchronisation and waits for that copy only, not for steps launched after it.

The runner reads the frozen step plan (scheduler/plan.py) and returns plain results (StepOutput: tokens,
logprob entries, prompt-logprob entries, speculation's verdicts); it writes no Request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cache.forward_batch import ForwardBatch
from ..env import yoco_keep_tokens, yoco_prefill, yoco_prefill_min_tokens
from ..parallel.dispatch import idle_step
from deepinfer.kernels.sampling import gumbel_argmax

from ..sampling.sampler import SALT_TARGET, build_sampling_tensors, logprobs, processed_logits
from ..scheduler.plan import ScheduledRow, StepPlan
from ..speculative.config import SpeculativeConfig
from ..structured import apply_grammar_masks
from .graphs import StepGraphs
from .inputs import PROMPT_LOGPROB_ROWS, StepInputs, logprob_entry, prompt_logprob_entries
from .speculate import Rows, Speculator


@dataclass
class StepOutput:
    """Sampled tokens of one step, still on the device until resolve(). Row r of `sampled` owns tokens
    offsets[r] .. offsets[r] + sampled[r].num_logits - 1."""
    sampled: list[ScheduledRow]
    tokens: torch.Tensor | None                      # [M] on the device
    offsets: list[int] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)   # request id -> its last sampled token in `tokens`
    lp: tuple | None = None              # (token rows [R], chosen [R], rank [R], top ids [R, k], top values [R, k])
    verdicts: tuple | None = None        # speculation: (accepted [R], next drafts [R, gamma], confidences [R, gamma])
    prompt_logprobs: list[tuple[ScheduledRow, list[dict]]] = field(default_factory=list)   # per prompt-logprob
                                         # piece: its new entries (on the host already)
    _host: list | None = None            # pinned copies of [tokens, *lp, *verdicts] (CUDA), filled behind the work
    _ready: object = None                # torch.cuda.Event recorded after those copies

    def _device(self) -> list:
        return [self.tokens, *(self.lp or ()), *(self.verdicts or ())]

    def start_copy(self) -> None:
        """Begin the device->host copy of the tokens and logprobs (CUDA): resolve() then waits for this step's
        work only, where a plain .tolist() would wait for every step launched after it too."""
        if self.tokens is None or self.tokens.device.type != "cuda":
            return
        self._host = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
            t, non_blocking=True) for t in self._device()]
        self._ready = torch.cuda.Event()
        self._ready.record(torch.cuda.current_stream(self.tokens.device))   # the copies' stream, not cuda:0's

    def wait(self) -> None:
        """Block until this step's tokens are on the host (its copies done; a CPU step's are there already)."""
        if self._ready is not None:
            self._ready.synchronize()

    def _host_lists(self) -> list:
        self.wait()
        return self._host if self._ready is not None else self._device()

    def speculation(self) -> list[tuple[int, list[int], list[float]]] | None:
        """Per sampled row (after resolve): (drafts accepted, the next drafts, their confidences); None without
        a speculator."""
        if self.verdicts is None:
            return None
        accepted, drafts, conf = (t.tolist() for t in self._host_lists()[-3:])
        return list(zip(accepted, drafts, conf))

    def resolve(self) -> list[tuple[ScheduledRow, list[int], list[dict | None]]]:
        """Per sampled row: its sampled tokens (one per logit position, in position order; a verified row: the
        tokens it commits first, see speculation()) and their logprob entries (None where not asked)."""
        if self.tokens is None:
            return []
        host = self._host_lists()
        toks = host[0].tolist()
        entries: dict[int, dict] = {}
        if self.lp is not None:
            rows, chosen, rank, ids, vals = (t.tolist() if t is not None else None for t in host[1:6])
            owner = {o + j: r for r, (s, o) in enumerate(zip(self.sampled, self.offsets)) for j in range(s.num_logits)}
            for j, t in enumerate(rows):
                k = self.sampled[owner[t]].params.logprobs
                entries[t] = logprob_entry(toks[t], chosen[j], rank[j], ids[j][:k] if k else (), vals[j][:k] if k else ())
        return [(s, toks[o:o + s.num_logits], [entries.get(t) for t in range(o, o + s.num_logits)])
                for s, o in zip(self.sampled, self.offsets)]


class ModelRunner:
    def __init__(self, model, pools, cuda_graphs: bool, max_graph_batch: int, fixed_context: bool = False,
                 truncate_prefill: bool | None = None, truncate_min_tokens: int | None = None,
                 speculative: SpeculativeConfig | None = None, truncate_keep: int | None = None):
        """pools: the state pools the steps run over (cache/pools.StatePools); truncate_prefill (default
        DEEPINFER_YOCO_PREFILL): mark pieces that need at most their last row's logits `last_only`, which a model
        that can (V4.1's exact YOCO truncation) runs on a shrinking suffix; pieces shorter than truncate_min_tokens
        (default DEEPINFER_YOCO_PREFILL_MIN_TOKENS) are not marked; truncate_keep: the rows compact truncation keeps
        (default: DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE and _KEEP_TOKENS, whose default is the exact mode)."""
        self.model, self.pools = model, pools
        self.fixed_context = fixed_context          # batch-invariant mode: every row reads all block columns
        self.truncate = yoco_prefill() if truncate_prefill is None else truncate_prefill
        self.truncate_min_tokens = yoco_prefill_min_tokens() if truncate_min_tokens is None else truncate_min_tokens
        # truncated pieces keep a constant KEEP rows (compact, approximate) or the exact shrinking suffix (None)
        self.truncate_keep = yoco_keep_tokens() if truncate_keep is None else truncate_keep
        # speculation: variable-length verify steps of up to max_graph_batch rows of drafts + 1 tokens are graphs too
        max_rows = max_graph_batch * (speculative.num_speculative_tokens + 1) if speculative else None
        self.graphs = StepGraphs(self.static_logits, model.device, max_graph_batch, max_rows) \
            if cuda_graphs and model.device.type == "cuda" else None
        self.graph_replays = 0
        self.ran_rows = 0
        # A drafter that reads the model's draft rings (Drafting.rings) turns this on: every step then keeps them current.
        self.keep_draft_rings = speculative is not None
        self.speculator = Speculator(model, self.pools, speculative, fixed_context,
                                     self.graphs.sizes if self.graphs is not None else None) if speculative else None

    @property
    def cuda_graphs(self) -> bool:
        return self.graphs is not None

    def graph_keys(self) -> list[tuple]:
        """The CUDA graphs captured so far: step graphs' keys, and ("draft", *key) for draft-block graphs."""
        keys = list(self.graphs.graphs) if self.graphs is not None else []
        if self.speculator is not None and self.speculator.graphs is not None:
            keys += [("draft", *k) for k in self.speculator.graphs.graphs]
        return keys

    @torch.inference_mode()
    def execute(self, plan: StepPlan, prev: StepOutput | None,
                before_sample: Callable[[], set[str]] | None = None,
                ring_marks: dict[int, list[tuple[int, int]]] | None = None) -> StepOutput:
        """Launch the step's forward, call before_sample (host work that overlaps it; it returns the ids of the
        requests that ended meanwhile), then sample. ring_marks: slot -> [(B, seat)]: the rings of that slot's
        segment as after position B go to snapshot seat `seat` too (the state manager's interior snapshots)."""
        inputs = StepInputs.build(plan.rows, prev, self.model.device)
        marks = [(g, at, seat) for g, slot in enumerate(inputs.slots) for at, seat in (ring_marks or {}).get(slot, ())]
        logits, hidden = self._forward(inputs, not marks, marks)
        if logits is not None:
            self.graph_replays += 1
            return self._sample(inputs, logits, before_sample, prev=prev)
        rows = inputs.logit_rows_tensor()                      # rows of hidden that need logits
        pieces = inputs.prompt_logprob_rows()
        recorded = []
        for s, piece in pieces:         # hidden rows and fp32 logits a block at a time, never a whole long prompt's
            done, entries = s.prompt_logprobs_done, []         # rows recorded before a preemption
            for a in range(piece.start + done - done % PROMPT_LOGPROB_ROWS, piece.stop, PROMPT_LOGPROB_ROWS):
                b = min(a + PROMPT_LOGPROB_ROWS, piece.stop)
                entries += prompt_logprob_entries(s, self.model.logits(hidden[rows[a:b]]), a - piece.start)
            recorded.append((s, entries))
        if pieces:
            rows = rows[inputs.sample_rows_in_logits()]
        return self._sample(inputs, self.model.logits(hidden[rows]), before_sample, recorded, prev)

    @torch.inference_mode()
    def run_shape(self, inputs: StepInputs, graphed: bool = True) -> torch.Tensor:
        """One step of a synthetic shape (StepInputs.shaped) over the pools, run as execute runs a step of that
        shape: a CUDA-graph replay where execute would replay one (graphed=False: eager regardless), else the
        eager forward with execute's truncation rule, keeping the draft rings when the engine does. Returns the
        logits [M, V] of inputs.logit_rows. The probe, the step-rate profile and the memory profile run this."""
        logits, hidden = self._forward(inputs, graphed)
        return logits if logits is not None else self.model.logits(hidden[inputs.logit_rows_tensor()])

    def drop_graphs(self) -> None:
        """Forget the captured step graphs (the model's modules changed under them, as a rank view changes its
        MoE layers: a replay would run the old ones); the next step of each shape captures anew."""
        if self.graphs is not None:
            self.graphs.clear()

    @torch.inference_mode()
    def shared_forward(self, slot: int, start: int, tokens: torch.Tensor, share) -> torch.Tensor:
        """One prefill segment, tokens [n] from position `start` of `slot`, whose rows are shared over
        context-parallel ranks (share: parallel/context_parallel.TokenInterleave; every rank writes the whole
        state): eager, untruncated, without draft rings -> the final hidden [Q, D] of this rank's rows share.rows."""
        n = tokens.shape[0]
        fb = ForwardBatch.ragged(self.pools, [slot], [start], [n], self._context_blocks(start + n), row_share=share)
        self.ran_rows = share.rows.shape[0]
        return self.model.forward(tokens[share.rows], fb)

    @torch.inference_mode()
    def idle_step(self) -> None:
        """One token at position 0 of scratch slot 0, eager: what a rank with no work runs so every rank of an
        expert-parallel engine meets each MoE layer's collectives."""
        token = torch.zeros(1, dtype=torch.long, device=self.model.device)
        with idle_step():                             # its token is no request's: routing counters skip it
            self.run_shape(StepInputs.shaped([0], [0], [1], token), graphed=False)

    def static_logits(self, seg_slots: torch.Tensor, seg_starts: torch.Tensor, seg_lens: torch.Tensor,
                      q: int | None, rows: int, ctx_blocks: int, draft_rings: bool, tokens: torch.Tensor
                      ) -> torch.Tensor:
        """What a step graph captures (runner/graphs.py): logits [rows, V] of a step of static shape from device
        tensors, G segments (seg_slots, seg_starts [G]) of q rows each, or of seg_lens [G] rows (q None)."""
        if q is not None:
            fb = ForwardBatch.uniform(self.pools, seg_slots, seg_starts, q, ctx_blocks, draft_rings)
        else:
            fb = ForwardBatch.varlen(self.pools, seg_slots, seg_starts, seg_lens, rows, ctx_blocks, draft_rings)
        return self.model.logits(self.model.forward(tokens, fb))

    def _forward(self, inputs: StepInputs, graphed: bool = True, ring_marks=()
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run a step's forward: (its logits, None) when a CUDA graph replayed it (every row sampled, a shape on the
        graphs' ladders), else (None, hidden [N, D]) from the eager forward (ForwardBatch's ring_marks). Sets
        ran_rows."""
        ctx = self._context_blocks(inputs.max_position + 1)
        self.ran_rows = inputs.tokens.shape[0]              # rows the step runs (a graph's: padding included)
        if graphed and self.graphs is not None and inputs.all_sampled:
            logits = self.graphs.run(inputs, ctx, self.keep_draft_rings)
            if logits is not None:
                self.ran_rows = self.graphs.last_rows
                return logits, None
        last_only = self._last_only(inputs, {g for g, _, _ in ring_marks})
        fb = ForwardBatch.ragged(self.pools, inputs.slots, inputs.starts, inputs.lens, ctx, last_only,
                                 draft_rings=self.keep_draft_rings, keep_tokens=self.truncate_keep,
                                 ring_marks=ring_marks)
        return None, self.model.forward(inputs.tokens, fb)

    def _last_only(self, inputs: StepInputs, marked: set[int] = frozenset()) -> list[bool] | None:
        """Segments marked last_only (truncate_prefill): those that need at most their last row's logits, no
        prompt logprobs, and are at least truncate_min_tokens long; never a `marked` one (its ring marks need
        every row's state at every layer)."""
        if not self.truncate:
            return None
        trailing, before = inputs.needs()
        return [k <= 1 and n >= self.truncate_min_tokens and not b and g not in marked
                for g, (n, k, b) in enumerate(zip(inputs.lens, trailing, before))]

    def _context_blocks(self, num_tokens: int) -> int:
        """Block-table columns the step reads: the longest row's blocks rounded up to a power of two (few graph
        shapes); all columns in batch-invariant mode (shapes independent of the batch)."""
        if self.fixed_context:
            return self.pools.max_blocks
        need = max(self.pools.layout.blocks_for(num_tokens), 1)
        return min(1 << (need - 1).bit_length(), self.pools.max_blocks)

    # ---- sampling ----
    @staticmethod
    def _in_flight(prev, pending: list[int], src: list[int]) -> tuple[list[int], torch.Tensor] | None:
        """The penalty rows' outputs still in flight: (their logit rows, prev's tokens at their indices)."""
        if not pending:
            return None
        return pending, prev.tokens[torch.tensor(src, dtype=torch.long).to(prev.tokens.device, non_blocking=True)]

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, before_sample=None,
                prompt_logprobs: list | None = None, prev=None) -> StepOutput:
        """logits [M, V]: the sampled rows' logit positions, row by row in position order; prompt_logprobs: the
        step's prompt-logprob entries (StepOutput.prompt_logprobs); prev: the step in flight (its tokens count
        into penalty rows whose host output list does not hold them yet)."""
        ended = before_sample() if before_sample is not None else None
        sampled = inputs.sampled
        if not sampled:
            return StepOutput([], None, prompt_logprobs=prompt_logprobs or [])
        rows, positions, outputs, n_out, before = [], [], [], [], []
        pending, pending_src = [], []              # rows whose last output is still in flight: its index in prev
        for s in sampled:
            if s.num_outputs > len(s.output_ids) and s.params.uses_penalties:
                if s.num_logits != 1 or s.num_outputs - len(s.output_ids) != 1 or prev is None:
                    raise RuntimeError(f"internal: request {s.request_id} samples with "
                                       f"{s.num_outputs - len(s.output_ids)} outputs unknown to the host")
                pending.append(len(rows))
                pending_src.append(prev.index[s.request_id])
            for j in range(s.num_logits):
                p = s.start + s.n - s.num_logits + j                # this logit row's position; it samples p + 1
                drafts = list(s.draft_ids[:j])                       # drafts before it count as outputs
                rows.append(s)
                positions.append(p + 1)
                outputs.append(s.output_ids + drafts if drafts else s.output_ids)
                n_out.append(s.num_outputs + len(drafts))
                before.append(drafts)
        # so_args rows: only legal tokens stay finite, each verify logit row masked by the matcher after the drafts
        # before it. A request that ended in the step before_sample read is not masked: its row here is dropped.
        apply_grammar_masks(logits, [s.grammar if not ended or s.request_id not in ended else None for s in rows],
                            before)
        t = build_sampling_tensors([s.params for s in rows], [s.seed for s in rows], positions, logits.shape[-1],
                                   logits.device, [s.prompt_ids for s in rows], outputs,
                                   self.model.cfg.eos_token_id, n_out, self._in_flight(prev, pending, pending_src))
        x, noise_rows = processed_logits(logits, t)
        tokens = gumbel_argmax(x, noise_rows, t.seeds, t.positions, SALT_TARGET)
        offsets, o = [], 0
        for s in sampled:
            offsets.append(o)
            o += s.num_logits
        verdicts = None
        if self.speculator is not None:
            verify = Rows.of(sampled, offsets, logits.device)
            tokens, accepted = self.speculator.verify(verify, x, noise_rows, tokens)
            verdicts = (accepted, *self.speculator.draft(verify, tokens, accepted))
        # index: each request's last sampled token, what an in-flight next step reads. A verify row's last
        # committed token is at off + accepted instead; speculation runs the synchronous loop, so nothing reads it
        out = StepOutput(sampled, tokens, offsets, {s.request_id: off + s.num_logits - 1
                                                    for s, off in zip(sampled, offsets)}, verdicts=verdicts,
                         prompt_logprobs=prompt_logprobs or [])
        want = [i for i, s in enumerate(rows) if s.params.logprobs is not None]
        if want:
            k = max(rows[i].params.logprobs for i in want)
            idx = torch.tensor(want, device=logits.device)
            out.lp = (idx, *logprobs(logits[idx], tokens[idx], k))
        out.start_copy()
        return out


__all__ = ["ModelRunner", "StepOutput"]
