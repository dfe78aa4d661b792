"""The step-rate profile speculative decoding's verify schedules need (speculative/step_rate.py): seconds per verify
step by context, segment count and batch tokens, measured on the device when the engine starts.

    tables = profile_step_rates(runner, manager, max_tokens=576, max_segments=96, contexts=profile_contexts(333, q=6))
    # {context: {segments R: {tokens B: seconds}}}; StepRateTable.from_dict(tables)

Each point is a step of R segments of B rows in all (R on the graph ladder 1, 2, 4, .. max_segments; every
segment 1 .. drafts + 1 rows, as even as they divide), one segment per sequence, on sequences seated for the
profile at the context (their state random noise, seat_random) with random input tokens (so the MoE routes them as
a real batch's tokens spread over the experts: identical tokens would all reach the same few experts and leave
most expert weights unread), run as variable-length verify steps run (their CUDA graphs, else eagerly), then the
draft block of the R rows; the median of `iters` after one warm-up. B runs over the row counts real steps run at:
where verify steps are graphs, the padded row counts of their graphs (R = 96, 6 rows a segment at most: 96, 128,
192, 256, 384, 512, 576), so every point is a shape real steps replay and nothing is measured at a padded cost it does
not show (a point of 288 rows ran as 384: the table then read the step from 192 to 288 rows as dearer than those
after it); eagerly, l x R for l = 1 .. drafts + 1. Host work (planning, commits) is not in it: the policy's online
calibration follows that. A context whose sequences the pools cannot hold is skipped (the table above it is
extrapolated). The graphs the profile captures are the ones real steps of those shapes replay later."""

from __future__ import annotations

import logging
import statistics
import time

import torch

from deepinfer.kernels.table import use

from ..speculative.config import SpeculativeConfig
from ..speculative.step_rate import StepRate, StepRateTable
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


def profile_points(max_tokens: int, max_segments: int, q: int, pad=None) -> dict[int, list[int]]:
    """{segments R: [batch rows B]}, R on the graph ladder up to max_segments: with pad(R, b) (the rows a
    variable-length step of b rows runs as, None when it runs eagerly: StepGraphs.varlen_rows) every distinct
    pad(R, b) for b = R .. q x R (b at most max_tokens); where R's steps run eagerly, B = l x R for l = 1 .. q (at
    most max_tokens). A point above q x R (the rung a step of q x R rows pads to) is timed with q x R rows."""
    out = {}
    for r in ladder(max(max_segments, 1)):
        if pad is None or pad(r, r) is None:
            tokens = [l * r for l in range(1, q + 1) if l * r <= max_tokens]
        else:
            tokens = sorted({pad(r, b) or b for b in range(r, min(q * r, max_tokens) + 1)})
        if tokens:
            out[r] = tokens
    return out


def step_rate_table(runner, manager, config: SpeculativeConfig, engine, kernels) -> StepRate | StepRateTable | None:
    """The step rate an engine's verify policy schedules by: none for the fixed schedule, the config's
    step_seconds as given, else profiled now on `runner` over `manager`'s seats (engine: its EngineConfig;
    kernels: the table its steps run under)."""
    if not config.varlen:
        return None
    if config.step_seconds:
        return StepRate.from_dict(dict(config.step_seconds))
    q = config.num_speculative_tokens + 1
    seats = min(engine.max_num_seqs, manager.num_slots)
    contexts = profile_contexts(engine.max_model_len, q)
    pad = runner.graphs.varlen_rows if runner.graphs is not None else None
    shapes = sum(map(len, profile_points(engine.max_num_batched_tokens, seats, q, pad).values()))
    # start-up work of seconds to minutes: say what it is and what sizes it, before it starts
    log.info("speculative step rate: profiling %d verify-step shapes at contexts %s on up to %d sequence(s) "
             "(max_num_seqs, max_model_len size it; speculative step_seconds skips it)", shapes, contexts, seats)
    t0 = time.perf_counter()
    with use(kernels):
        tables = profile_step_rates(runner, manager, engine.max_num_batched_tokens, seats, contexts, pad=pad)
    top = {c: max(by_r.items()) for c, by_r in tables.items()}
    log.info("speculative step rate profiled in %.1f s at contexts %s; ms per step at the most segments: %s",
             time.perf_counter() - t0, list(tables), "; ".join(
                 f"context {c}, {r} segments: " + ", ".join(f"{b}: {t * 1e3:.2f}" for b, t in row.items())
                 for c, (r, row) in top.items()))
    return StepRateTable.from_dict(tables)


@torch.inference_mode()
def profile_step_rates(runner, manager, max_tokens: int, max_segments: int, contexts: list[int], iters: int = 2,
                       seed: int = 0, pad=None) -> dict[int, dict[int, dict[int, float]]]:
    """{context: {segments: {batch tokens: seconds per step}}} on `runner`, its sequences seated by `manager` (see
    the module docstring); pad: the padded row counts to profile at (profile_points; default: the runner's
    graphs', none when it runs eagerly)."""
    model = runner.model
    q = runner.speculator.gamma + 1 if runner.speculator is not None else 1
    if pad is None and runner.graphs is not None:
        pad = runner.graphs.varlen_rows
    points = profile_points(max_tokens, max_segments, q, pad)
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
            out[context] = {r: {b: _time_step(runner, model, slots[:r], context, _even_split(min(b, q * r), r),
                                              gen, iters) for b in bs} for r, bs in points.items()}
        finally:
            for rid in rids[:seated]:
                manager.release(rid)
    if not out:
        raise RuntimeError("internal: the step-rate profile could not seat its sequences at context 0")
    return out


def _even_split(rows: int, segments: int) -> list[int]:
    """`rows` rows over `segments` segments, as even as they divide (the longer ones first)."""
    base, extra = divmod(rows, segments)
    return [base + 1] * extra + [base] * (segments - extra)


def _time_step(runner, model, slots: list[int], context: int, lens: list[int], gen, iters: int) -> float:
    """Median seconds of one profiled step: a segment of lens[i] rows on slots[i], each at `context` (module
    docstring), run as the engine runs a verify step of that shape (runner.run_shape), then its draft block."""
    dev = model.device
    r, n = len(slots), sum(lens)
    tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen).to(dev)
    inputs = StepInputs.shaped(slots, [context] * r, lens, tokens)
    seg_slots = torch.tensor(slots, dtype=torch.long, device=dev)
    ends = torch.tensor(lens, dtype=torch.long).cumsum(0)
    last_row = (ends - 1).to(dev)
    anchor_pos = (context + torch.tensor(lens, dtype=torch.long) - 1).to(dev)
    zeros = torch.zeros(r, dtype=torch.long, device=dev)
    times = []
    for i in range(iters + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        picks = runner.run_shape(inputs).argmax(dim=-1)
        if runner.speculator is not None:          # and the step's draft block, one row per segment
            runner.speculator.draft_block(seg_slots, anchor_pos, picks[last_row], zeros, zeros.float())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
