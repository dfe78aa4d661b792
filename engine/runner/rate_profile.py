"""The step-rate profile speculative decoding's verify schedules need (spec/step_rate.py): seconds per engine step
by batch tokens, at several contexts, measured on the device when the engine starts.

    tables = profile_step_rates(runner, max_tokens=576, contexts=profile_contexts(max_model_len, q=6))
    # {context: {tokens: seconds}}; ContextStepRate.from_dict(tables)

Each point runs a step shaped as real verify steps are: B tokens in segments of drafts + 1 rows (the last one
shorter), one segment per sequence, on sequences seated for the profile at the context (their state random noise,
seat_random) with random input tokens (so the MoE routes them as a real batch's tokens spread over the experts:
identical tokens would all reach the same few experts and leave most expert weights unread), run as the engine
runs it (a CUDA-graph replay, a variable-length one when the segments differ, else eagerly), then the draft block
of those rows; the median of `iters` after one warm-up. Host work (planning, commits) is not in it: the policy's
online calibration follows that. A context whose sequences the pools cannot hold is skipped (the tables above it
are extrapolated). The graphs the profile captures are the ones real steps of those shapes replay later."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from ..cache.forward_batch import ForwardBatch
from .inputs import StepInputs
from .probe import seat_random

log = logging.getLogger("deepinfer")

FIRST_CONTEXT = 256          # profiled contexts: 0, then 256 x 4^k, and the longest a verify row can start at
CONTEXT_GROWTH = 4
MAX_PROFILED_CONTEXT = 16384  # beyond it the table is extrapolated (profiling long contexts costs start-up time)


def profile_contexts(max_model_len: int, q: int) -> list[int]:
    """Contexts to profile: 0, 256, 1024, .. (x4) up to MAX_PROFILED_CONTEXT, and the longest one a row of q
    positions can start at (max_model_len - q) when it is below that cap."""
    top = max(max_model_len - q, 0)
    out, c = [0], FIRST_CONTEXT
    while c < min(top, MAX_PROFILED_CONTEXT + 1):
        out.append(c)
        c *= CONTEXT_GROWTH
    if top <= MAX_PROFILED_CONTEXT and top > out[-1]:
        out.append(top)
    return out


def token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, .. and max_tokens."""
    m = max(max_tokens, 1)
    return sorted({1 << k for k in range(m.bit_length()) if 1 << k <= m} | {m})


@torch.inference_mode()
def profile_step_rates(runner, max_tokens: int, contexts: list[int], iters: int = 3, seed: int = 0
                       ) -> dict[int, dict[int, float]]:
    """{context: {batch tokens: seconds per step}} on `runner` (see the module docstring)."""
    manager, model = runner.manager, runner.model
    q = runner.speculator.gamma + 1 if runner.speculator is not None else 1
    counts = token_counts(max_tokens)
    rids = [f"step-rate-{i}" for i in range(-(-counts[-1] // q))]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[int, dict[int, float]] = {}
    for context in contexts:
        seated = seat_random(manager, rids, context + q, seed)
        try:
            if seated < len(rids):
                log.warning("step-rate profile: the state pools hold %d of %d sequences of %d positions; context "
                            "%d is not profiled (extrapolated from the shorter ones)", seated, len(rids),
                            context + q, context)
                continue
            slots = [manager.slot(r) for r in rids]
            out[context] = {b: _time_step(runner, model, slots, context, b, q, gen, iters) for b in counts}
        finally:
            for rid in rids[:seated]:
                manager.release(rid)
    if not out:                                  # not even context 0 fits: one sequence's worth of the old way
        raise RuntimeError("internal: the step-rate profile could not seat its sequences at context 0")
    return out


def _time_step(runner, model, slots: list[int], context: int, b: int, q: int, gen, iters: int) -> float:
    """Median seconds of one profiled step of b tokens at `context` (module docstring)."""
    dev = model.device
    lens = [q] * (b // q) + ([b % q] if b % q else [])
    r = len(lens)
    tokens = torch.randint(0, model.cfg.vocab_size, (b,), generator=gen).to(dev)
    uniform = lens[0] if len(set(lens)) == 1 else None
    inputs = StepInputs([], slots[:r], [context] * r, lens, tokens, [], context + q - 1, uniform, True)
    ctx = runner._context_blocks(context + q)
    seg_slots = torch.tensor(slots[:r], dtype=torch.long, device=dev)
    last_row = torch.tensor(lens, device=dev).cumsum(0) - 1
    anchor_pos = context + torch.tensor(lens, dtype=torch.long, device=dev) - 1
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
