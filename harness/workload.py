"""Benchmark workloads: random-token prompts as InferenceX draws them (prefix caching cannot help), and one
measured point on the engine at a fixed concurrency.

Lengths: with range ratio r each request's input length is drawn uniformly from [ceil(r * ISL), ISL] and its
output length from [ceil(r * OSL), OSL] (InferenceX: "each input is 80-100 % of nominal ISL" at r = 0.8); the
draws depend only on the seed. Concurrency c = at most c sequences in the engine at once, all requests ready at
the start (request rate infinite, as `--max-concurrency c --request-rate inf`); a request's clock starts when
the engine admits it (the moment a client holding one of c slots would send it), so TTFT excludes the wait
for a slot, as in vLLM's client. Outputs ignore EOS, so every request produces its drawn length."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from deepinfer import SamplingParams

from .metrics import RequestTiming


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def random_workload(n: int, isl: int, osl: int, range_ratio: float, vocab_size: int, seed: int,
                    reserved_ids: int = 16) -> Workload:
    """n random-token requests; ids below `reserved_ids` (specials) are never drawn."""
    if not 0 < range_ratio <= 1:
        raise ValueError(f"range_ratio={range_ratio} must be in (0, 1]")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(math.ceil(range_ratio * isl), isl + 1, size=n)
    out_lens = rng.integers(math.ceil(range_ratio * osl), osl + 1, size=n)
    prompts = [rng.integers(reserved_ids, vocab_size, size=int(k)).tolist() for k in in_lens]
    return Workload(prompts, [int(k) for k in out_lens])


def run_workload(llm, work: Workload, concurrency: int, seed: int) -> tuple[list[RequestTiming], float]:
    """Run every request at the given concurrency; returns per-request records and the wall duration."""
    import time
    before = llm.args["max_num_seqs"]
    llm.args["max_num_seqs"] = concurrency          # seats of this run (the pools were sized for the maximum)
    try:
        params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, seed=seed + i)
                  for i, k in enumerate(work.output_lens)]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], params, use_tqdm=False)
        duration = time.perf_counter() - t0
    finally:
        llm.args["max_num_seqs"] = before
    records = []
    for out, prompt in zip(outs, work.prompts):
        m, done = out.metrics[0], out.outputs[0]
        records.append(RequestTiming(m.first_scheduled_time, list(m.token_times), len(prompt), len(done.token_ids),
                                     out.finished))
    return records, duration
