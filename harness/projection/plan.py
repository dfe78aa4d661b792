"""`deepinfer-bench plan`: which deployment of G GPUs serves the most output tokens under a TPOT SLO, projected
(docs/projection.md, "Plan").

Candidates: every expert-parallel width e that divides G (G / e replicas of an EP-e engine with attention data
parallelism on every rank), each with DSpark off, fixed and confidence-scheduled. A candidate fits when one rank holds
its weights (the dense layers and the LM head whole, 1/e of the routed experts) and the state of its batch in the
GPU's memory; its batch is the largest whose projected TPOT meets the SLO (memory permitting), and its figure the
output tokens/s per GPU at that batch. EP widths without rank-view rows are listed with what to measure, never
guessed. Redundant experts (EPLB) and context parallelism are not candidates yet: the rank view has no rows with
redundant slots, and context parallelism changes prefill, not the decode TPOT this plans for."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from deepinfer.errors import DeepInferError

from .sweep import Projection, decode_step, projection_for

ALIASES = {"v4.1-flash": "deepseek-ai/DeepSeek-V4.1-Flash-1017", "v4-flash": "deepseek-ai/DeepSeek-V4-Flash"}
MODES = ("off", "fixed", "confidence")
MEMORY_USE = 0.9            # of the GPU's memory for weights and state (the engine's gpu_memory_utilization)
MAX_BATCH = 1024            # sequences a rank: the search's ceiling


@dataclass(frozen=True)
class Candidate:
    ep: int
    replicas: int
    spec_mode: str
    batch_per_rank: int | None          # None: does not fit, or not calibrated (`why`)
    tpot_ms: float | None
    tok_s_per_gpu: float | None
    tok_s_per_user: float | None
    weights_gib: float | None           # one rank's weights
    why: str = ""
    flags: tuple[str, ...] = ()

    def fields(self) -> dict:
        return asdict(self)


def model_id(name: str) -> str:
    """V4.1-Flash / V4-Flash (any case) or a model spec the projection knows."""
    return ALIASES.get(name.lower(), name)


def parse_tpot(text: str) -> float:
    """'30ms', '30', '0.03s' -> milliseconds."""
    t = text.strip().lower()
    try:
        ms = float(t[:-2]) if t.endswith("ms") else float(t[:-1]) * 1e3 if t.endswith("s") else float(t)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise DeepInferError(f"--slo-tpot {text!r}: give a positive time per output token such as 30ms or 0.03s")
    return ms


def _weights_and_state(proj: Projection, ep: int, context: float) -> tuple[float, float]:
    """(one rank's weight bytes, one sequence's state bytes at `context`) at the model's depth."""
    cal = proj.decode
    w = cal.weight_bytes
    if w is None:
        raise DeepInferError(f"the calibration run {cal.run} records no EP 1 weight bytes; rerun it with --ep 1 "
                             f"among its sizes")
    head = proj.shape.vocab * proj.shape.hidden * 2         # the LM head (and the embedding, as big) once
    depth = proj.shape.layers / cal.layers
    weights = (w["dense"] - head) * depth + 2 * head + w["experts"] * depth / ep
    return weights, w["state_per_token"] * context * depth


def plan(gpus: int, model: str, slo_tpot_ms: float, report_dir, hardware: str | None = None, isl: int = 1024,
         osl: int = 1024, calibration: str | None = None, modes=MODES) -> tuple[Projection, list[Candidate]]:
    """Every candidate, best first (the ones that fit, by tok/s per GPU; then the others)."""
    from deepinfer.speculative.config import speculation_label, speculative_config
    if gpus < 1 or isl < 1 or osl < 1:
        raise DeepInferError(f"--gpus {gpus} --isl {isl} --osl {osl}: give at least 1 of each")
    if not (math.isfinite(slo_tpot_ms) and slo_tpot_ms > 0):
        raise DeepInferError(f"--slo-tpot {slo_tpot_ms:g} ms: give a positive time")
    spec_model = model_id(model)
    proj = projection_for(spec_model, "deepep", ("decode",), report_dir, hardware, calibration)
    context = isl + osl / 2                                 # the mean context of a generation
    memory = proj.hardware.memory_gib * 2 ** 30 * MEMORY_USE
    specs = {m: speculative_config(False if m == "off" else {"schedule": m}, 5, proj.target.drafter) for m in modes}
    out = []
    for ep in (e for e in range(1, gpus + 1) if gpus % e == 0):
        for mode, spec in specs.items():
            label = "none" if spec is None else speculation_label(spec)
            base = dict(ep=ep, replicas=gpus // ep, spec_mode=label)
            if ep not in proj.decode.ep_sizes():
                out.append(Candidate(**base, batch_per_rank=None, tpot_ms=None, tok_s_per_gpu=None,
                                     tok_s_per_user=None, weights_gib=None,
                                     why=f"EP {ep} not calibrated: `deepinfer-bench step --ep {ep} ...` measures it"))
                continue
            weights, per_seq = _weights_and_state(proj, ep, context)
            fits = int((memory - weights) // per_seq) if per_seq else MAX_BATCH
            if fits < 1:
                out.append(Candidate(**base, batch_per_rank=None, tpot_ms=None, tok_s_per_gpu=None,
                                     tok_s_per_user=None, weights_gib=weights / 2 ** 30,
                                     why=f"one rank's weights ({weights / 2 ** 30:.0f} GiB) exceed "
                                         f"{MEMORY_USE:.0%} of the {proj.hardware.name}'s {proj.hardware.memory_gib} GiB"))
                continue
            out.append(_best_batch(proj, ep, context, spec, base, min(fits, MAX_BATCH), slo_tpot_ms, weights))
    ok = sorted((c for c in out if c.tok_s_per_gpu is not None), key=lambda c: -c.tok_s_per_gpu)
    return proj, ok + [c for c in out if c.tok_s_per_gpu is None]


def _best_batch(proj: Projection, ep: int, context: float, spec, base: dict, most: int, slo_ms: float,
                weights: float) -> Candidate:
    """The largest batch up to `most` whose TPOT meets the SLO (TPOT grows with batch: a bisection)."""
    def at(b: int):
        return decode_step(proj, ep, b, context, spec)
    if at(1).tpot_s * 1e3 > slo_ms:
        got = at(1)
        return Candidate(**base, batch_per_rank=None, tpot_ms=got.tpot_s * 1e3, tok_s_per_gpu=None,
                         tok_s_per_user=None, weights_gib=weights / 2 ** 30,
                         why=f"even one sequence a rank takes {got.tpot_s * 1e3:.1f} ms a token", flags=got.flags)
    lo, hi = 1, most
    while lo < hi:                                          # the largest b with TPOT(b) <= SLO
        mid = (lo + hi + 1) // 2
        if at(mid).tpot_s * 1e3 <= slo_ms:
            lo = mid
        else:
            hi = mid - 1
    got = at(lo)
    why = "" if lo < most else "memory bounds the batch" if most < MAX_BATCH else f"batch capped at {MAX_BATCH}"
    return Candidate(**base, batch_per_rank=lo, tpot_ms=got.tpot_s * 1e3,
                     tok_s_per_gpu=lo * got.accepted / (got.projected.step_ms / 1e3),
                     tok_s_per_user=1 / got.tpot_s, weights_gib=weights / 2 ** 30, why=why, flags=got.flags)


def table(candidates: list[Candidate], top: int) -> list[str]:
    """The best `top` that fit, then one line for each kind of candidate that does not."""
    lines = [f"{'rank':>4} {'EP x replicas':>13} {'DSpark':<20} {'batch/rank':>10} {'TPOT ms':>8} {'tok/s/GPU':>9} "
             f"{'tok/s/user':>10}  note"]
    fit = [c for c in candidates if c.tok_s_per_gpu is not None]
    for i, c in enumerate(fit[:top], 1):
        lines.append(f"{i:>4} {f'{c.ep} x {c.replicas}':>13} {c.spec_mode:<20} {c.batch_per_rank:>10} "
                     f"{c.tpot_ms:>8.1f} {c.tok_s_per_gpu:>9.0f} {c.tok_s_per_user:>10.1f}  {c.why}")
    seen = set()
    for c in candidates:
        if c.tok_s_per_gpu is None and (c.ep, c.why.split(":")[0]) not in seen:
            seen.add((c.ep, c.why.split(":")[0]))
            lines.append(f"{'-':>4} {f'{c.ep} x {c.replicas}':>13} {'':<20} {'':>10} {'':>8} {'':>9} {'':>10}  "
                         f"{c.why}")
    if not fit:
        lines.append("no candidate meets the SLO: loosen --slo-tpot, or measure the EP widths listed")
    return lines
