"""Random routers that route like trained ones.

A trained DeepSeek router is balanced by its selection bias: the auxiliary-loss-free rule nudges each expert's
bias down by u when the expert got more than its share of a batch and up when it got less (b_e -= u sign(load_e -
target_e)). Drawn at random, the bias (std 0.5) outweighs the sqrt-softplus scores' spread across tokens (~0.3), so
a random model sends almost every token to the same few experts. calibrate_routers runs that rule on a seeded
sample after the weights are drawn, layer by layer in forward order: each gate's bias is fitted on the gate's own
inputs, which already carry the calibrated routing of every layer before it (one forward, a pre-hook per gate).

The sample is what the harness's figures come from: random token ids over the whole vocabulary (sweeps, step,
structured, versus and DSpark rows send them). One bias cannot balance two inputs that route differently, and a
random model routes text unlike random ids: on the tiny-width flash-shaped V4, biases fitted on ids alone leave
held-out ids at 1.23-1.26x the mean load (chance at that load: ~1.2) and text at 4-6x; fitted on half ids, half
text, ids 1.6-1.7x and text 2.1-2.3x (docs/results.md). Rows on text prompts (DSpark --prompts, eval) say what
they saw in their own traffic fields. Hash-routed layers keep their tid2eid tables. V4.1's DSpark stages and
V4's MTP layer are calibrated on their own draft inputs.

Skew: `skew` S > 0 fits the biases to a Zipf-like load instead of an even one: the expert of rank r (a seeded
permutation per layer) gets a share proportional to (r + E/16)^-S of the routed pairs (Zipf-Mandelbrot; the offset
keeps the head realistic: S = 0.8 gives the hottest expert ~4x the mean load and the hottest tenth ~27% of the
traffic at E = 384, where pure r^-0.8 would give 32x), capped at 1/k (a token picks distinct experts, so no
expert can take more than every token). A real property of the weights, as a trained model's hot experts are.
docs/bench.md tabulates the load curve it gives."""

from __future__ import annotations

import logging
import math
import time
import torch

from .. import reference
from ..models.common.moe import Gate
from ..validate import check_router_skew

log = logging.getLogger("deepinfer")

# Bump when the calibration changes what it writes: cached embedded models carry it in their directory name.
CALIBRATION_VERSION = 3        # 1: half random ids, half text (never published); 2: on every build's own forward
                               # (3 fits models up to make.TWIN_MAX_PARAMETERS on a float32 twin; larger ones as 2)
SAMPLE_LENGTH = 256            # tokens per calibration sequence
PAIRS_PER_EXPERT = 256         # routed (token, slot) pairs per expert the sample is sized for: E k^-1 256 tokens
ITERATIONS = 300               # sign-rule steps per gate
FINAL_STEP = 1e-4              # the last step's size, relative to the first
ZIPF_OFFSET = 16               # skew: share of rank r ~ (r + E / ZIPF_OFFSET)^-S


def target_shares(n_experts: int, top_k: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """[E] fp64, the share of routed pairs each expert is fitted to (sums to 1): ~ (rank + E/16)^-skew, ranks from a
    seeded permutation; shares above 1/k are capped there and the excess spread over the others in proportion."""
    rank = torch.randperm(n_experts, generator=gen) + 1
    share = (rank.double() + n_experts / ZIPF_OFFSET) ** -float(skew)
    share /= share.sum()
    cap = 1.0 / top_k
    for _ in range(n_experts):
        over = share > cap
        if not over.any():
            break
        excess = (share[over] - cap).sum()
        share[over] = cap
        free = ~over & (share < cap)
        share[free] += excess * share[free] / share[free].sum()
    return share


def fit_bias(scores: torch.Tensor, top_k: int, share: torch.Tensor, iterations: int = ITERATIONS) -> torch.Tensor:
    """scores [N, E] fp32 (the router's selection scores before bias) -> bias [E] fp32 whose top-k selection gives
    each expert its `share` of the N*k pairs: the sign rule b -= u sign(load - target), u decaying geometrically
    from a tenth of the scores' spread to FINAL_STEP of that (deterministic: the same scores give the same bits)."""
    n, e = scores.shape
    target = (share.to(scores.device, torch.float32) * n * top_k)
    bias = torch.zeros(e, dtype=torch.float32, device=scores.device)
    step = 0.1 * float(scores.std()) + 1e-6
    decay = FINAL_STEP ** (1.0 / max(iterations - 1, 1))
    ones = torch.ones(n * top_k, dtype=torch.float32, device=scores.device)
    for _ in range(iterations):
        ids = (scores + bias).topk(top_k, dim=-1).indices.reshape(-1)
        load = torch.zeros(e, dtype=torch.float32, device=scores.device).index_add_(0, ids, ones)
        bias -= step * torch.sign(load - target)
        step *= decay
    return bias - bias.mean()


def sample_sequences(cfg) -> int:
    """Sequences of SAMPLE_LENGTH in the calibration sample: enough tokens that the widest learned router of the
    main stack sees PAIRS_PER_EXPERT pairs per expert on balance (at least 4 sequences; 64 for V4.1 flash)."""
    tokens = PAIRS_PER_EXPERT * cfg.n_routed_experts / cfg.num_experts_per_tok
    return max(4, math.ceil(tokens / SAMPLE_LENGTH))


def calibration_ids(cfg, seed: int, sequences: int | None = None, length: int = SAMPLE_LENGTH) -> torch.Tensor:
    """[sequences, length] int64 random ids over the vocabulary, from `seed` (the harness's random prompts)."""
    sequences = sample_sequences(cfg) if sequences is None else sequences
    return torch.randint(0, cfg.vocab_size, (sequences, length), generator=torch.Generator().manual_seed(seed))


def routed_gates(model: torch.nn.Module) -> list[tuple[str, Gate]]:
    """(name, gate) of every learned-score router in `model` (hash-routed gates excluded), in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Gate) and not m.is_hash]


@torch.no_grad()
def calibrate_routers(model: torch.nn.Module, seed: int, skew: float = 0.0) -> dict[str, int]:
    """Fit every learned router's selection bias (balanced, or to `skew`) on a seeded sample; returns
    {gate name: tokens it was fitted on}. The model's own forward supplies each gate's inputs."""
    skew = check_router_skew(skew)
    gates = routed_gates(model)
    if not gates:
        return {}
    gen = torch.Generator().manual_seed(seed ^ 0x5EED)
    shares = {id(g): target_shares(g.n_experts, g.top_k, skew, gen) for _, g in gates}
    fitted: dict[str, int] = {}
    names = {id(g): n for n, g in gates}

    def fit(gate: Gate, args):
        if names[id(gate)] in fitted:
            return
        x = args[0]
        gate.bias.copy_(fit_bias(gate.selection_scores(x), gate.top_k, shares[id(gate)]))
        fitted[names[id(gate)]] = int(x.shape[0])

    t0 = time.perf_counter()
    handles = [g.register_forward_pre_hook(fit) for _, g in gates]
    try:
        _sample_forwards(model, calibration_ids(model.cfg, seed).to(model.device))
    finally:
        for h in handles:
            h.remove()
    missing = [n for n, _ in gates if n not in fitted]
    if missing:
        raise RuntimeError(f"router calibration never reached {missing}")
    log.info("routers: %d selection biases fitted (skew %g) on %d tokens in %.1f s", len(fitted), skew,
             max(fitted.values()), time.perf_counter() - t0)
    return fitted


def _sample_forwards(model, ids: torch.Tensor) -> None:
    """The forwards that reach every gate: the main stack on the whole sample, then the draft layers (V4.1's
    DSpark stages, V4's MTP layer) on drafts from every position of it."""
    with torch.inference_mode():
        flat, chunks = reference.batch_chunks(model, ids)
        out = reference.forward_reference(model, flat, chunks, [reference.new_state(model) for _ in chunks])
        method = None if model.drafting is None else model.drafting.method
        if method == "mtp":
            next_ids = torch.roll(flat, -1)
            reference.mtp_forward(model, out, next_ids, chunks, [reference.new_state(model) for _ in chunks])
        elif method == "dspark":
            _dspark_sample(model, ids)


def _dspark_sample(model, ids: torch.Tensor, prompt: int = 16, blocks: int = 256) -> None:
    """DSpark stages see one draft block after each sequence's last token: `blocks` sequences of `prompt` tokens
    cut from the sample give each stage blocks x block-size rows in one call (1280 rows at V4.1's 5)."""
    rows = ids.reshape(-1, prompt)[:blocks]
    reference.extend_and_draft(model, list(rows), [reference.new_state(model) for _ in range(rows.shape[0])])
