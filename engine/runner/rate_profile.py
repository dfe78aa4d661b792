"""The step-rate profile speculative decoding's verify schedules need (spec/step_rate.py): seconds per verify
step by context, segment count and batch tokens, measured on the device when the engine starts.

    tables = profile_step_rates(runner, max_tokens=576, max_segments=96, contexts=profile_contexts(333, q=6))
    # {context: {segments R: {tokens B: seconds}}}; StepRateTable.from_dict(tables)

Each point is a step of R segments of l rows (B = l x R tokens; l = 1 .. drafts + 1, R on the graph ladder 1, 2,
4, .. max_segments), one segment per sequence, on sequences seated for the profile at the context (their state
random noise, seat_random) with random input tokens (so the MoE routes them as a real batch's tokens spread over
the experts: identical tokens would all reach the same few experts and leave most expert weights unread), run as
variable-length verify steps run (their CUDA graphs, else eagerly), then the draft block of the R rows; the median
of `iters` after one warm-up. Host work (planning, commits) is not in it: the policy's online calibration follows
that. A context whose sequences the pools cannot hold is skipped (the table above it is extrapolated). The graphs
the profile captures are the ones real steps of those shapes replay later."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ..cache.forward_batch import ForwardBatch
from .graphs import ladder
from .inputs import StepInputs
from .probe import seat_random

log = logging.getLogger("deepinfer")

FIRST_CONTEXT = 2048          # profiled contexts: 0, then 2048 x 8^k, and the longest a verify row can start at
CONTEXT_GROWTH = 8
MAX_PROFILED_CONTEXT = 16384  # beyond it the table is extrapolated (profiling long contexts costs start-up time)


def profile_contexts(max_model_len: int, q: int) -> list[int]:
    """Contexts to profile: 0, 2048, 16384 (a verify row's attention work is linear in its context between them:
    window, compressed entries, indexer keys) below the longest one a row of q positions can start at
    (max_model_len - q), and that one when it is below MAX_PROFILED_CONTEXT."""
    top = max(max_model_len - q, 0)
    out, c = [0], FIRST_CONTEXT
    while c < min(top, MAX_PROFILED_CONTEXT + 1):
        out.append(c)
        c *= CONTEXT_GROWTH
    if top <= MAX_PROFILED_CONTEXT and top > out[-1]:
        out.append(top)
    return out


def profile_points(max_tokens: int, max_segments: int, q: int) -> dict[int, list[int]]:
    """{segments R: [l x R for l = 1 .. q]}, R on the graph ladder up to max_segments, B <= max_tokens."""
    out = {}
    for r in ladder(max(max_segments, 1)):
        tokens = [l * r for l in range(1, q + 1) if l * r <= max_tokens]
        if tokens:
            out[r] = tokens
    return out


@torch.inference_mode()
def profile_step_rates(runner, max_tokens: int, max_segments: int, contexts: list[int], iters: int = 2,
                       seed: int = 0) -> dict[int, dict[int, dict[int, float]]]:
    """{context: {segments: {batch tokens: seconds per step}}} on `runner` (see the module docstring)."""
    manager, model = runner.manager, runner.model
    q = runner.speculator.gamma + 1 if runner.speculator is not None else 1
    points = profile_points(max_tokens, max_segments, q)
    rids = [f"step-rate-{i}" for i in range(max(points))]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[int, dict[int, dict[int, float]]] = {}
    for context in contexts:
        seated = seat_random(manager, rids, context + q, seed)
        try:
            if seated < len(rids):
                log.warning("step-rate profile: the state pools hold %d of %d sequences of %d positions; context "
                            "%d is not profiled (extrapolated from the shorter ones)", seated, len(rids),
                            context + q, context)
                continue
            slots = [manager.slot(r) for r in rids]
            out[context] = {r: {b: _time_step(runner, model, slots[:r], context, b // r, gen, iters) for b in bs}
                            for r, bs in points.items()}
        finally:
            for rid in rids[:seated]:
                manager.release(rid)
    if not out:
        raise RuntimeError("internal: the step-rate profile could not seat its sequences at context 0")
    return out


def _time_step(runner, model, slots: list[int], context: int, rows: int, gen, iters: int) -> float:
    """Median seconds of one profiled step: len(slots) segments of `rows` rows at `context` (module docstring)."""
    dev = model.device
    r = len(slots)
    lens = [rows] * r
    tokens = torch.randint(0, model.cfg.vocab_size, (rows * r,), generator=gen).to(dev)
    inputs = StepInputs([], slots, [context] * r, lens, tokens, [], context + rows - 1, None, True)  # varlen shape
    ctx = runner._context_blocks(context + rows)
    seg_slots = torch.tensor(slots, dtype=torch.long, device=dev)
    last_row = torch.arange(1, r + 1, device=dev) * rows - 1
    anchor_pos = torch.full((r,), context + rows - 1, dtype=torch.long, device=dev)
    zeros = torch.zeros(r, dtype=torch.long, device=dev)
    times = []
    for i in range(iters + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        logits = runner.graphs.run(inputs, ctx, runner.keep_draft_rings) if runner.graphs is not None else None
        if logits is None:
            fb = ForwardBatch.ragged(runner.pools, inputs.slots, inputs.starts, lens, ctx,
                                     draft_rings=runner.keep_draft_rings)
            logits = model.logits(model.forward(tokens, fb))
        picks = logits.argmax(dim=-1)
        if runner.speculator is not None:          # and the step's draft block, one row per segment
            runner.speculator.draft_block(seg_slots, anchor_pos, picks[last_row], zeros, zeros.float())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
