"""Benchmark workloads: random-token prompts as InferenceX draws them (prefix caching cannot help), and one
measured point on the engine at a fixed concurrency.

Lengths: with range ratio r each request's input length is drawn uniformly from [ceil(r * ISL), ISL] and its
output length from [ceil(r * OSL), OSL] (InferenceX: "each input is 80-100 % of nominal ISL" at r = 0.8); the
draws depend only on the seed. Concurrency c = at most c sequences in the engine at once, all requests ready at
the start (request rate infinite, as `--max-concurrency c --request-rate inf`); a request's clock starts when a
client holding c slots would send it (the first c at once, then one as each finishes), so TTFT excludes the
wait for a slot but includes any wait inside the engine, as vLLM's client measures it. Outputs ignore EOS, so every request produces its drawn length."""

from __future__ import annotations

import contextlib
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
                    reserved_ids: int = 16, shared: float = 0.0, prefix_seed: int | None = None) -> Workload:
    """n random-token requests; ids below `reserved_ids` (specials) are never drawn. shared: every prompt starts
    with the same round(shared x isl) tokens (drawn from prefix_seed, default the seed: a point's warm-up and timed
    requests pass one, so they share them), then its own random tail to its drawn length."""
    if not 0 < range_ratio <= 1:
        raise ValueError(f"range_ratio={range_ratio} must be in (0, 1]")
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(math.ceil(range_ratio * isl), isl + 1, size=n)
    out_lens = rng.integers(math.ceil(range_ratio * osl), osl + 1, size=n)
    head = np.random.default_rng([seed if prefix_seed is None else prefix_seed, 1]).integers(reserved_ids, vocab_size, size=round(shared * isl)).tolist()
    prompts = [head + rng.integers(reserved_ids, vocab_size, size=max(int(k) - len(head), 1)).tolist()
               for k in in_lens]
    return Workload(prompts, [int(k) for k in out_lens])


@contextlib.contextmanager
def seats(llm, concurrency: int):
    """Inside: the engine runs at most `concurrency` sequences at once (the pools were sized for its maximum)."""
    with llm.engine.concurrency_limit(concurrency):
        yield


def client_send_times(t0: float, finished: list[float], concurrency: int) -> list[float]:
    """When a client holding `concurrency` slots sends each request (in order): the first c at t0, request k >= c
    when the (k - c + 1)-th request to finish has finished."""
    done = sorted(finished)
    return [t0 if k < concurrency else max(t0, done[k - concurrency]) for k in range(len(finished))]


def run_workload(llm, work: Workload, concurrency: int, local: bool = False) -> tuple[list[RequestTiming], float]:
    """Run every request (greedy, exactly its drawn output length) at the given concurrency; returns per-request
    records and the wall duration (run_requests)."""
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in work.output_lens]
    _, records, duration = run_requests(llm, work.prompts, params, concurrency, local)
    return records, duration


def run_requests(llm, prompts: list[list[int]], params: list, concurrency: int, local: bool = False):
    """Token-id prompts with their SamplingParams at the given concurrency -> (RequestOutputs, per-request
    records, wall duration). A request's clock starts when the client would send it (client_send_times), so time
    queued in the engine (for step budget or state blocks) counts in its TTFT, as vLLM's client measures.
    local: this rank's own share of a multi-rank point (LLM.generate_local; possibly none, at concurrency 0,
    where an expert-parallel rank runs idle steps until the others are done)."""
    import time
    generate = llm.generate_local if local else llm.generate
    with seats(llm, concurrency) if prompts else contextlib.nullcontext():
        t0 = time.perf_counter()
        outs = generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        duration = time.perf_counter() - t0
    sent = client_send_times(t0, [o.metrics[0].finished_time for o in outs], concurrency)
    return outs, [RequestTiming(start, list(o.metrics[0].token_times), len(p), len(o.outputs[0].token_ids),
                                o.finished) for start, o, p in zip(sent, outs, prompts)], duration


def run_turns(llm, work: Workload, turns: int, concurrency: int, vocab_size: int, seed: int,
              reserved_ids: int = 16) -> tuple[list[RequestTiming], float, list[list[int]], list[list[int]]]:
    """Multi-turn chat: every conversation of `work` runs `turns` turns; turn t's prompt is turn t-1's prompt and
    output plus a new user message as long as the conversation's first prompt (random tokens). The turns run one
    after another, the conversations of a turn at `concurrency`. Returns every turn's records, the summed wall
    time, the prompts in the order they were sent and the positions each computed (prompt + output less its last
    token, which is sampled, never fed)."""
    rng = np.random.default_rng([seed, 2])
    prompts, records, duration, sent, held = list(work.prompts), [], 0.0, [], []
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in work.output_lens]
    for turn in range(turns):
        outs, recs, took = run_requests(llm, prompts, params, concurrency)
        records += recs
        duration += took
        sent += prompts
        held += [p + list(o.outputs[0].token_ids)[:-1] for p, o in zip(prompts, outs)]
        if turn + 1 < turns:
            prompts = [p + list(o.outputs[0].token_ids) + rng.integers(reserved_ids, vocab_size, size=len(first)).tolist()
                       for p, o, first in zip(prompts, outs, work.prompts)]
    return records, duration, sent, held
