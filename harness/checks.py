"""`deepinfer-bench determinism` and `deepinfer-bench batch-invariance`: does a request get the same tokens
(and logprobs) whatever runs beside it? Both run with batch-invariant mode off and on and write one row per
(mode, sampling) to a run directory, plus a short table.

Each mode is its own engine over the one loaded model (`LLM.with_kernel_backend`: the engine's kernel set and its
batch-invariant partner, e.g. "reference" / "invariant" on CPU, "triton" / "triton_invariant" on CUDA),
so the mode never outlives the check and nothing process-wide is switched.

determinism: the same prompts N times, greedy and with fixed seeds; run r shuffles the prompts (seeded by r)
and cycles the concurrency through 1, 2, 4 and all, so rows change places and neighbours between runs. Per
prompt: how many distinct outputs the N runs gave, and the first token position where any run departs from
run 0.
batch-invariance: a needle prompt alone, then at a random slot of batches of 2..16 random prompts of random
lengths; its tokens and per-token logprobs compared bitwise with the alone run."""

from __future__ import annotations

import logging
import time

import numpy as np

from deepinfer import SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.kernels.registry import DEFAULT_OF, INVARIANT_OF

from .bench import RunFolder
from .rows import METHOD_VERSION, environment, identity, run_dir_guard
from .workload import random_workload, seats

log = logging.getLogger("deepinfer")
SAMPLINGS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=0.8, top_p=0.95, seed=1234)}
CHECK_MODES = {"both": [False, True], "on": [True], "off": [False]}      # --mode -> batch-invariant mode off / on


def check_modes(given: str | None) -> list[bool]:
    """--mode as the modes to run. DEEPINFER_BATCH_INVARIANT=1 lets the engine run batch-invariant kernels only,
    so the default becomes `on`, and a --mode that runs the default kernels is refused naming both."""
    from .limits import INVARIANT_VAR, batch_invariant_env
    invariant = batch_invariant_env()
    if given is None:
        return CHECK_MODES["on" if invariant else "both"]
    if invariant and given != "on":
        raise DeepInferError(f"--mode {given} runs batch-invariant mode off (the default kernels), but "
                             f"{INVARIANT_VAR}=1 allows batch-invariant kernels only: use --mode on (or leave --mode "
                             f"out), or unset {INVARIANT_VAR}")
    return CHECK_MODES[given]


def with_mode(llm, on: bool):
    """The engine in batch-invariant mode (on: the "invariant" kernel backend, fixed decode shapes and chunk
    grid) or not ("reference"): `llm` itself when it runs that mode, else a twin sharing its model and pools."""
    base = llm.engine.kernel_backend
    return llm.with_kernel_backend(INVARIANT_OF[base] if on else DEFAULT_OF[base])


def _generate(llm, prompts, params, concurrency: int):
    with seats(llm, concurrency):
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def first_divergence(outputs: list[list[int]]) -> int | None:
    """First token index where any output departs from outputs[0] (length differences count); None if all agree."""
    ref, first = outputs[0], None
    for out in outputs[1:]:
        n = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if n is None and len(out) != len(ref):
            n = min(len(out), len(ref))
        if n is not None:
            first = n if first is None else min(first, n)
    return first


def determinism(llm, prompts: list[list[int]], runs: int, max_tokens: int) -> dict[str, dict]:
    """{sampling: {"unique": [per prompt], "first_divergence": [per prompt]}} for the engine's current mode."""
    result = {}
    for name, kw in SAMPLINGS.items():
        outs = [[] for _ in prompts]
        for r in range(runs):
            order = np.random.default_rng(r).permutation(len(prompts))
            conc = [1, 2, 4, len(prompts)][r % 4]
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)
            got = _generate(llm, [prompts[i] for i in order], sp, conc)
            for slot, i in enumerate(order):
                outs[i].append(list(got[slot].outputs[0].token_ids))
        result[name] = {"unique": [len({tuple(o) for o in per}) for per in outs],
                        "first_divergence": [first_divergence(per) for per in outs]}
    return result


def batch_invariance(llm, needle: list[int], trials: int, max_tokens: int, seed: int) -> dict[str, dict]:
    """{sampling: {"trials", "token_mismatches", "logprob_mismatches", "first_divergence"}} for the current mode."""
    vocab = llm.model.cfg.vocab_size
    result = {}
    for name, kw in SAMPLINGS.items():
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=1, **kw)
        alone = _generate(llm, [needle], sp, 1)[0].outputs[0]
        rng = np.random.default_rng(seed)
        tok_bad = lp_bad = 0
        diverge = []
        for t in range(trials):
            size = int(rng.integers(2, 17))
            fill = random_workload(size - 1, max(8, len(needle)), max_tokens, 0.25, vocab, seed + 100 + t)
            slot = int(rng.integers(0, size))
            batch = fill.prompts[:slot] + [needle] + fill.prompts[slot:]
            params = [SamplingParams(max_tokens=k, ignore_eos=True, **kw) for k in fill.output_lens]
            params = params[:slot] + [sp] + params[slot:]
            got = _generate(llm, batch, params, size)[slot].outputs[0]
            tok_bad += got.token_ids != alone.token_ids
            lp_bad += got.logprobs != alone.logprobs
            diverge.append(first_divergence([alone.token_ids, got.token_ids]))
        result[name] = {"trials": trials, "token_mismatches": int(tok_bad), "logprob_mismatches": int(lp_bad),
                        "first_divergence": diverge}
    return result


def run_checks(llm, kind: str, modes: list[bool], run_dir, prompts, runs: int, trials: int, max_tokens: int,
               seed: int) -> list[dict]:
    """Run `kind` ("determinism" | "batch-invariance") in each mode; append and return one row per
    (mode, sampling). `run_dir` is made here and removed again if the check fails before its first row."""
    with run_dir_guard(run_dir):
        store, env = RunFolder(run_dir, None, resumable=False).open(), environment()
        rows = []
        for on in modes:
            engine = with_mode(llm, on)
            t0 = time.perf_counter()
            res = determinism(engine, prompts, runs, max_tokens) if kind == "determinism" else \
                batch_invariance(engine, prompts[0], trials, max_tokens, seed)
            log.info(f"{kind}, batch-invariant mode {'on' if on else 'off'}: {time.perf_counter() - t0:.1f} s")
            for sampling, stats in res.items():
                row = {**_identity(llm, engine, kind, env, max_tokens), "sampling": sampling,
                       "key": f"{kind}/{'invariant' if on else 'default'}/{sampling}", **stats}
                store.append(row)
                rows.append(row)
    return rows


def _identity(llm, engine, kind: str, env: dict, max_tokens: int) -> dict:
    """The fields every row of a check run carries (`engine`: the mode's engine)."""
    return identity(env, METHOD_VERSION, packages=False, check=kind, status="ok",
                    batch_invariant=engine.batch_invariant, kernel_backend=engine.stats.kernel_backend,
                    model_type=llm.model.cfg.model_type, device=str(llm.model.device),
                    dtype=str(llm.model.dtype).replace("torch.", ""), max_tokens=max_tokens)
