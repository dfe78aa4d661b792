"""Batched sampling on the device: penalties, temperature, top-k / top-p / min-p, and seeded Gumbel-max.

Seeded noise is counter-based: the Gumbel variable of vocabulary id v for the token at absolute position p
of a request with seed s is a pure function of (s, p, v, salt), a SplitMix64 hash turned into a uniform in
(0, 1). So a seeded request draws the same tokens whatever batch row it occupies, whoever shares the batch,
and after preemption and recompute (design notes, techniques §4). Distinct salts keep target sampling,
draft sampling and acceptance uniforms independent. Greedy rows take the argmax, ties to the lowest id. The hash
and the draw are the op kernels/sampling.py (`gumbel_argmax`: one Triton pass over the logits on the GPU).

Order (as vLLM): penalties on the raw logits -> temperature -> min-p, top-k, top-p filters -> sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from deepinfer.kernels.precision import upcast
from deepinfer.kernels.sampling import gumbel_argmax

from .id_tensors import IdTensors

SALT_TARGET, SALT_DRAFT, SALT_ACCEPT, SALT_RESAMPLE, SALT_PINNED = 0, 1, 2, 3, 4
MIN_TEMPERATURE = 0.01
# the requests' prompt and output ids as host int64 arrays, grown step by step (engine/sampling/id_tensors.py); the
# engine samples from one thread, and this is the only writer
REQUEST_IDS = IdTensors()


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step, on the logits' device. Rows with temperature 0 are greedy."""
    temperature: torch.Tensor         # [B] float32
    top_k: torch.Tensor               # [B] int64, <= 0: off
    top_p: torch.Tensor               # [B] float32, 1: off
    min_p: torch.Tensor               # [B] float32, 0: off
    seeds: torch.Tensor               # [B] int64
    positions: torch.Tensor           # [B] int64: absolute position of the token being sampled
    repetition_penalty: torch.Tensor | None = None   # [B] float32, 1: off
    presence_penalty: torch.Tensor | None = None     # [B] float32
    frequency_penalty: torch.Tensor | None = None    # [B] float32
    prompt_mask: torch.Tensor | None = None          # [B, V] bool: ids in the prompt (repetition penalty)
    output_counts: torch.Tensor | None = None        # [B, V] int32: counts of generated ids
    banned: torch.Tensor | None = None               # [B, V] bool: ids that must not be drawn (min_tokens)
    host_flags: dict | None = None                   # which filters any row uses, known on the host (no sync)

    def uses(self, name: str, tensor_check) -> bool:
        return self.host_flags[name] if self.host_flags is not None else bool(tensor_check())


def build_sampling_tensors(params: list, seeds: list[int], positions: list[int], vocab: int, device,
                           prompt_ids: list[list[int]] | None = None, output_ids: list[list[int]] | None = None,
                           eos_token_id: int | None = None, num_outputs: list[int] | None = None,
                           in_flight: tuple[list[int], torch.Tensor] | None = None) -> SamplingTensors:
    """One step's SamplingTensors from each row's SamplingParams. seeds: the request seed (params.seed, else
    the one the engine drew when the request was created); positions: the absolute position being sampled;
    prompt_ids / output_ids: for the penalties and min_tokens (rows still below min_tokens may not draw EOS
    or a stop token id); num_outputs: output lengths when they include tokens still in flight (default: the
    lengths of output_ids); in_flight: (rows, tokens [len(rows)] on the device): each listed row's output that
    is not in output_ids yet (the previous step's sample, still in flight), counted into the penalties on the
    device, so a penalty row never waits for the host to read it."""
    b = len(params)
    for name, per_row in (("prompt_ids", prompt_ids), ("output_ids", output_ids), ("num_outputs", num_outputs)):
        if per_row is not None and len(per_row) != b:
            raise ValueError(f"{name} has {len(per_row)} rows for {b} sampled rows")
    # host tensor, then an asynchronous copy: torch.tensor(..., device=cuda) would wait for the step's forward
    as_t = lambda vals, dt: torch.tensor(vals, dtype=dt).to(device, non_blocking=True)  # noqa: E731
    t = SamplingTensors(
        temperature=as_t([p.temperature for p in params], torch.float32),
        top_k=as_t([p.top_k for p in params], torch.long), top_p=as_t([p.top_p for p in params], torch.float32),
        min_p=as_t([p.min_p for p in params], torch.float32), seeds=as_t(seeds, torch.long),
        positions=as_t(positions, torch.long))
    outputs = output_ids or [[] for _ in range(b)]
    if any(p.repetition_penalty != 1 for p in params):
        t.repetition_penalty = as_t([p.repetition_penalty for p in params], torch.float32)
        t.prompt_mask = _per_row_ids(prompt_ids or [[] for _ in range(b)], vocab, device, REQUEST_IDS) > 0
    if any(p.uses_penalties for p in params):
        t.presence_penalty = as_t([p.presence_penalty for p in params], torch.float32)
        t.frequency_penalty = as_t([p.frequency_penalty for p in params], torch.float32)
        t.output_counts = _per_row_ids(outputs, vocab, device, REQUEST_IDS)
        if in_flight is not None and in_flight[0]:
            rows = torch.tensor(in_flight[0], dtype=torch.long).to(device, non_blocking=True)
            ids = in_flight[1].to(torch.long)
            ok = (ids >= 0) & (ids < vocab)          # as _per_row_ids: an id outside the vocabulary counts nowhere
            t.output_counts.index_put_((rows, ids.clamp(0, vocab - 1)), ok.to(torch.int32), accumulate=True)
    lengths = num_outputs if num_outputs is not None else [len(o) for o in outputs]
    early = [i for i, p in enumerate(params) if lengths[i] < p.min_tokens]
    if early:
        stops = [[] for _ in range(b)]
        for i in early:
            stops[i] = list(params[i].stop_token_ids) + ([] if eos_token_id is None or params[i].ignore_eos
                                                         else [eos_token_id])
        t.banned = _per_row_ids(stops, vocab, device) > 0
    t.host_flags = {"greedy": all(p.temperature <= 0 for p in params), "min_p": any(p.min_p > 0 for p in params),
                    "top_k": any(p.top_k > 0 for p in params), "top_p": any(p.top_p < 1 for p in params)}
    return t


def _per_row_ids(rows: list[list[int]], vocab: int, device, cache: IdTensors | None = None) -> torch.Tensor:
    """[B, V] int32 counts of each row's ids (ids outside the vocabulary dropped). The ids cross to the device in one
    copy and land in one scatter-add, where a tensor and a bincount per row were 2B launches a step (512 at batch
    256 with penalties on); integer adds, so the counts are exact whatever the order. cache: the lists' host
    arrays kept from step to step (the requests' own prompt and output lists), else converted here."""
    counts = torch.zeros(len(rows), vocab, dtype=torch.int32, device=device)
    lens = [len(ids) for ids in rows]
    if not any(lens):
        return counts
    if cache is not None:
        ids = torch.from_numpy(np.concatenate([cache(r) for r in rows if r]))                    # host
    else:
        ids = torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long)                   # host
    flat = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lens)) * vocab + ids   # row * V + id
    flat = flat[(ids >= 0) & (ids < vocab)].to(device, non_blocking=True)   # a negative id would land in the row before
    counts.view(-1).scatter_add_(0, flat, torch.ones(flat.shape, dtype=torch.int32, device=device))
    return counts


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition penalty over prompt and output ids (positive logits divided, negative multiplied);
    frequency and presence penalties over output ids, subtracted (as vLLM / OpenAI)."""
    counts = t.output_counts
    if t.repetition_penalty is not None:
        seen = counts > 0 if counts is not None else torch.zeros_like(logits, dtype=torch.bool)
        if t.prompt_mask is not None:
            seen = seen | t.prompt_mask
        rep = t.repetition_penalty.unsqueeze(1).to(logits.dtype)
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if counts is not None:
        if t.frequency_penalty is not None:
            logits = logits - t.frequency_penalty.unsqueeze(1).to(logits.dtype) * counts.to(logits.dtype)
        if t.presence_penalty is not None:
            logits = logits - t.presence_penalty.unsqueeze(1).to(logits.dtype) * (counts > 0).to(logits.dtype)
    return logits


def apply_filters(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature-scaled logits [B, V] -> the same with filtered-out ids at -inf (min-p, top-k, top-p).
    Ties at a top-k / top-p boundary keep every tied id (a value threshold, independent of id order)."""
    neg = float("-inf")
    if t.banned is not None:
        logits = logits.masked_fill(t.banned, neg)
    if t.host_flags is not None and not (t.host_flags["min_p"] or t.host_flags["top_k"] or t.host_flags["top_p"]):
        return logits                             # no filter on: skip the softmax and the vocabulary sort
    probs = torch.softmax(logits, dim=-1)
    if t.uses("min_p", lambda: (t.min_p > 0).any()):
        floor = t.min_p.unsqueeze(1).to(probs.dtype) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, neg)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    if t.uses("top_k", lambda: (t.top_k > 0).any()):
        k = torch.where(t.top_k > 0, t.top_k, torch.full_like(t.top_k, logits.shape[-1])).clamp(max=logits.shape[-1])
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, neg)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg)
    if t.uses("top_p", lambda: (t.top_p < 1).any()):
        sorted_probs = torch.softmax(sorted_logits.double(), dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs          # mass strictly above each sorted id
        keep = before < t.top_p.unsqueeze(1).to(before.dtype)       # the smallest prefix reaching top_p
        keep |= (t.top_p >= 1).unsqueeze(1)                           # top_p = 1 is off, whatever the rounding
        keep[:, 0] = True
        cutoff = sorted_logits.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits < cutoff, neg)
    return logits


def sample(logits: torch.Tensor, t: SamplingTensors, salt: int = SALT_TARGET) -> torch.Tensor:
    """logits [B, V] (>= fp32 model output) -> token ids [B]. Temperatures below MIN_TEMPERATURE are raised to
    it (as vLLM), so logits / T stays finite; 0 means greedy."""
    x, noise_rows = processed_logits(logits, t)
    return gumbel_argmax(x, noise_rows, t.seeds, t.positions, salt)   # argmax: the lowest id among equal maxima


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the draw takes: penalties, banned ids, temperature and filters applied -> (x [B, V], the rows that add
    noise [B] bool, None when every row is greedy). softmax(x) of a random row is its target distribution
    (speculative verification reads it); greedy rows keep their unscaled logits (argmax unchanged)."""
    logits = apply_penalties(upcast(logits), t)
    greedy = t.temperature <= 0
    if t.banned is not None:
        logits = logits.masked_fill(t.banned, float("-inf"))
    if t.uses("greedy", lambda: greedy.all()):
        return logits, None
    # greedy rows: logits / 1 and filters that never drop a row's maxima, so argmax(scaled) = argmax(logits)
    return apply_filters(logits / temperature_divisor(t.temperature), t), ~greedy


def temperature_divisor(temperature: torch.Tensor) -> torch.Tensor:
    """What each row's logits are divided by [B, 1]: its temperature raised to at least MIN_TEMPERATURE (as vLLM,
    so logits / T stays finite), 1 for greedy rows (temperature 0). The target's draw and the drafters' share it."""
    raised = temperature.clamp(min=MIN_TEMPERATURE)
    return torch.where(temperature > 0, raised, torch.ones_like(temperature)).unsqueeze(1)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int = 0):
    """Raw-model log-probabilities (as vLLM returns by default): (logprob of `tokens` [B], their rank [B] (1 + how
    many tokens are strictly more likely, so ties share the better rank), top-k ids [B, k], top-k logprobs [B, k])."""
    lp = torch.log_softmax(upcast(logits), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1)).squeeze(1)
    rank = (lp > chosen.unsqueeze(1)).sum(dim=-1) + 1
    if k <= 0:
        return chosen, rank, None, None
    top = lp.topk(k, dim=-1)
    return chosen, rank, top.indices, top.values
