"""One rank of a data-parallel (and expert-parallel) generate, run under torchrun by tests/test_parallel.py:
    torchrun --nproc-per-node N tests/distributed/generate_worker.py OUT.json '{"model": ..., LLM kwargs}'
Every rank runs the same generate; rank 0 writes the outputs (token ids, logprobs), the preemptions, draft
tokens, context-parallel prefills and routed load of all ranks, and rank 0's EPLB rebalances, as JSON."""

import json
import sys

from deepinfer import LLM, SamplingParams
from deepinfer.errors import DeepInferError


def main(out_path: str, spec: str) -> int:
    kw = json.loads(spec)
    prompts, max_tokens = kw.pop("prompts"), kw.pop("max_tokens")
    stop_rank = kw.pop("stop_rank", None)        # that rank leaves before generating (a lost rank)
    try:
        llm = LLM(model=kw.pop("model"), device="cpu", skip_tokenizer_init=True, **kw)
        if llm.ranks is not None and llm.ranks.rank == stop_rank:
            return 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
    except DeepInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    preemptions, drafts, cp = llm.stats.preemptions, llm.stats.draft_tokens, llm.context_parallel_prefills
    load = {n: t.tolist() for n, t in zip(llm.traffic.names, llm.traffic.load)} if llm.traffic else {}
    if llm.ranks is not None:
        shares = llm.ranks.gather_objects((preemptions, drafts, load, cp))
        preemptions, drafts, cp = (sum(s[k] for s in shares) for k in (0, 1, 3))
        load = {n: [sum(s[2][n][e] for s in shares) for e in range(len(v))] for n, v in load.items()}
    if llm.ranks is None or llm.ranks.rank == 0:
        rows = [{"ids": o.outputs[0].token_ids,
                 "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                for o in outs]
        balancer = llm.balancer
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "preemptions": preemptions, "draft_tokens": drafts, "load": load,
                       "context_parallel_prefills": cp, "rebalances": balancer.rebalances if balancer else 0,
                       "moved_slots": balancer.moved_slots if balancer else 0}, f)
    return 0


if __name__ == "__main__":
    from worker_exit import run          # this folder is on sys.path: the script's own
    run(main)
