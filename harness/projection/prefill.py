"""Projected prefill: one rank's chunked-prefill step of T tokens in an EP-N prefill role, and the schedule that turns
a point's prompts into TTFTs (docs/projection.md, "Prefill").

Step: prefill is compute-bound and, with balanced routing, a rank of an EP-N role computes what one GPU computes for
its T tokens (its experts receive T x top_k pairs in all, as one GPU's would), so the compute term is T x the
per-token time of the step bench's one-GPU prefill of prompts as long as the point's (interpolated in prompt length),
scaled to the model's depth and to the target's GEMM rate;
the exchange of every MoE layer (DeepEP's normal kernels: a bandwidth table) overlaps it over two micro-batches,
as DeepSeek's prefill does.

Schedule: a point's c prompts are split over the role's ranks (data parallel); a rank packs its prompts' tokens into
steps of at most `budget` tokens (chunked prefill), so prompt i finishes with the step that holds its last token.
With fewer prompts than ranks, context parallelism splits each prompt over R // c ranks (balanced: each holds an
equal share of its tokens). The KV exchange of context parallelism is not counted (V4's compressed KV is small
next to the expert exchange; flagged)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .hardware import Profile
from .sources import PrefillCalibration
from .step import ModelShape, overlapped


@dataclass(frozen=True)
class PrefillStep:
    step_ms: float
    compute_ms: float
    comm_ms: float
    flags: tuple[str, ...]


def per_token_ms(cal: PrefillCalibration, prompt_len: float, flags: list[str]) -> float:
    """One token's share of the calibration's one-GPU prefill of a `prompt_len`-token prompt: busy(T) / T, linear
    in T between measured prompts (attention's share grows with the prompt); outside them, the nearest's (flagged:
    an overestimate for shorter prompts, an underestimate for longer)."""
    pts = cal.points
    if prompt_len <= pts[0].tokens or prompt_len >= pts[-1].tokens:
        edge = pts[0] if prompt_len <= pts[0].tokens else pts[-1]
        if prompt_len != edge.tokens:
            flags.append(f"prompts of {prompt_len:g} tokens outside the measured {pts[0].tokens}-{pts[-1].tokens}: "
                         f"the per-token time of {edge.tokens}-token prompts")
        return edge.busy_ms / edge.tokens
    hi = next(p for p in pts if p.tokens >= prompt_len)
    lo = pts[pts.index(hi) - 1]
    w = (prompt_len - lo.tokens) / (hi.tokens - lo.tokens)
    return (1 - w) * lo.busy_ms / lo.tokens + w * hi.busy_ms / hi.tokens


def project_prefill_step(cal: PrefillCalibration, measured_on: Profile, target: Profile, shape: ModelShape, comm,
                         ep: int, tokens: float, prompt_len: float, overlap: str = "two_micro_batches",
                         overlap_share: float = 1.0) -> PrefillStep:
    """One rank's prefill step of `tokens` tokens of `prompt_len`-token prompts in an EP-`ep` role on `target`
    GPUs; comm: op -> the fitted series of the prefill backend on target.link(ep) (unused at EP 1: no exchange)."""
    flags: list[str] = []
    compute = tokens * per_token_ms(cal, prompt_len, flags) * shape.layers / cal.layers
    if shape.layers != cal.layers:
        flags.append(f"prefill compute scaled from the calibration's {cal.layers} layers to {shape.layers}")
    if target.name != measured_on.name:
        compute *= measured_on.bf16_flops_per_s / target.bf16_flops_per_s
        flags.append(f"prefill compute scaled from {measured_on.name} to {target.name} by GEMM rate")
    comm_ms = 0.0
    if ep > 1:
        flags.append("exchange counted per expert copy (DeepEP's normal kernels send one per destination rank and "
                     "none to their own: an overestimate at small EP)")
        comm_ms = shape.exchange_ms(comm, ep, tokens, 2 if overlap == "two_micro_batches" else 1, flags)
    step = overlapped(compute, comm_ms, shape.layers, overlap, overlap_share) if ep > 1 else compute
    return PrefillStep(step, compute, comm_ms, tuple(dict.fromkeys(flags)))


@dataclass(frozen=True)
class PrefillSchedule:
    ttfts: list[float]           # seconds from each prompt's arrival (the start of its wave)
    duration: float              # seconds until the last prompt's last token
    flags: tuple[str, ...]


def schedule(prompt_lens: list[int], concurrency: int, ranks: int, budget: int, step_ms) -> PrefillSchedule:
    """TTFTs of prompts served `concurrency` at a time by `ranks` ranks with a `budget`-token step; step_ms(T): one
    step of T tokens on one rank. Prompts go to ranks round-robin in waves of `concurrency`; a wave ends when its
    slowest rank does (a closed loop refills as prompts finish: waves are the steady state of that)."""
    flags: list[str] = []
    group = max(ranks // concurrency, 1)           # ranks that share one prompt (context parallelism)
    if group > 1:
        flags.append(f"context parallel: each prompt over {group} ranks (its KV exchange not counted)")
    ttfts, clock = [], 0.0
    for start in range(0, len(prompt_lens), concurrency):
        wave = prompt_lens[start:start + concurrency]
        per_rank: dict[int, list[float]] = {}
        for i, n in enumerate(wave):               # each prompt's tokens on its rank (or its share on each of group)
            per_rank.setdefault(i % max(ranks // group, 1), []).append(n / group)
        wave_end = 0.0
        for queue in per_rank.values():
            # steps of `budget` tokens over the queue's tokens in order (the last one partial); prompt i finishes
            # with the step holding its last token, at cumulative position P_i
            total = sum(queue)
            sizes = [min(budget, total - j * budget) for j in range(math.ceil(total / budget))]
            ends = [0.0]
            for size in sizes:
                ends.append(ends[-1] + step_ms(size) / 1e3)
            position = 0.0
            for n in queue:
                position += n
                ttfts.append(ends[math.ceil(position / budget - 1e-9)])     # from its wave's start
            wave_end = max(wave_end, ends[-1])
        clock += wave_end
    return PrefillSchedule(ttfts, clock, tuple(flags))


def mean_len(isl: int, range_ratio: float) -> float:
    """The mean drawn length of [ceil(r x ISL), ISL] (harness/workload.py)."""
    return (math.ceil(range_ratio * isl) + isl) / 2
