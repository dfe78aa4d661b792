"""One rank of a context-parallel prefill, run under torchrun by tests/test_context_parallel.py:
    torchrun --nproc-per-node C tests/distributed/cp_prefill_worker.py OUT.json '{"arch": ..., "pieces": [n, ...]}'
Every rank builds the same tiny fp32 model and prefills the same prompt twice: on its own (the one-rank oracle, in
this process) and split over the C ranks (parallel/context_parallel.prefill), piece after piece; then each decodes
one token on both states. Rank 0 writes every rank's largest differences (state tensors, last-position logits,
decode logits) as JSON."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deepinfer.checkpoint.make import random_model  # noqa: E402
from deepinfer.kernels.kv_formats import raw  # noqa: E402
from deepinfer.kernels.table import use  # noqa: E402
from deepinfer.parallel.context_parallel import prefill  # noqa: E402
from deepinfer.parallel.ranks import Ranks  # noqa: E402
from deepinfer.runner.inputs import StepInputs  # noqa: E402
from deepinfer.runner.runner import ModelRunner  # noqa: E402
from tests.pooled_helpers import PooledSequences  # noqa: E402


def _state(seq: PooledSequences) -> dict[str, torch.Tensor]:
    pools = seq.pools
    return {**{n: raw(t) for n, t in pools.rings.items()}, **{n: raw(t) for n, t in pools.entries.items()}}


def main(out_path: str, spec: str) -> int:
    kw = json.loads(spec)
    dist.init_process_group("gloo")
    ranks = Ranks(dist.get_rank(), dist.get_world_size(), 0, "gloo")
    torch.manual_seed(0)
    model = random_model(kw["arch"], "tiny", 0, dtype=torch.float32)
    total = sum(kw["pieces"])
    tokens = torch.randint(5, model.cfg.vocab_size, (total + 1,), generator=torch.Generator().manual_seed(1))
    one, cp = PooledSequences(model, 1, total + 8), PooledSequences(model, 1, total + 8)
    # the engine's one-rank step (untruncated) is the oracle; the same runner class builds the shared step
    run_one, run_cp = (ModelRunner(model, seq.pools, False, 1, truncate_prefill=False) for seq in (one, cp))
    got, want, start = [], [], 0
    with use(kw.get("kernels", "invariant")):
        for n in kw["pieces"]:
            piece = tokens[start:start + n]
            want.append(run_one.run_shape(StepInputs.shaped([1], [start], [n], piece, [n - 1]))[0])
            got.append(prefill(run_cp, ranks, 1, start, piece))
            start += n
        state_one, state_cp = _state(one), _state(cp)      # after the prefill, before decoding changes the rings
        decoded = [r.run_shape(StepInputs.shaped([1], [total], [1], tokens[total:]))[0] for r in (run_one, run_cp)]
    diffs = {name: (state_cp[name] - state_one[name]).abs().max().item() for name in state_one}
    mine = {"state": max(diffs.values()), "worst": max(diffs, key=diffs.get),
            "logits": max((g - w).abs().max().item() for g, w in zip(got, want)),
            "decode": (decoded[1] - decoded[0]).abs().max().item(),
            "state_abs": max(t.abs().max().item() for t in state_one.values()),
            "kinds": len(diffs), "logits_abs": want[-1].abs().max().item()}
    every = ranks.gather_objects(mine)
    if ranks.rank == 0:
        Path(out_path).write_text(json.dumps(every))
    return 0


if __name__ == "__main__":
    from worker_exit import run          # this folder is on sys.path: the script's own
    run(main)
