"""One rank of a sharded checkpoint load and generate, run under torchrun by tests/test_sharded_loading.py (or as one
plain process, the single-process reference):
    torchrun --nproc-per-node N tests/distributed/load_worker.py OUT.json '{"model": CKPT_DIR, LLM kwargs}'
The loader's safe_open is wrapped, so every read from the shards is recorded (tensor name, and the rows of a
sliced read) and the bytes of the read tensors alive are tracked (weakref finalizers) for their peak during the
load (the tensors the model keeps, keep_quantized's on-disk ones, counted apart). Rank 0 writes every rank's
reads, that peak, the bytes its model holds (each routed-expert stack, the rest), the growth of the process's
peak RSS over the load, and the outputs (token ids, logprobs) as JSON."""

import gc
import json
import resource
import sys
import weakref

import deepinfer.checkpoint.loader as loader
from deepinfer import LLM, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.models.common.moe import Experts
from deepinfer.models.deepseek_v41.host_table import HostEngramEmbedding


class ReadLog:
    """Reads from the shards, and when each read tensor was freed (weakref finalizers)."""

    def __init__(self):
        self.reads: list[list] = []          # [tensor name, None | [start, stop]]
        self.events: list[tuple[int, int]] = []     # (read number, +bytes when read / -bytes when freed)

    def took(self, name: str, rows, tensor):
        n, i = tensor.numel() * tensor.element_size(), len(self.reads)
        self.reads.append([name, rows])
        self.events.append((i, n))
        weakref.finalize(tensor, self.events.append, (i, -n))
        return tensor

    def peaks(self) -> tuple[int, int]:
        """(the most bytes of read tensors alive at once that the load let go again, the bytes it kept: the
        on-disk tensors keep_quantized attaches to the model). Call when the load has returned."""
        freed = {i for i, n in self.events if n < 0}
        live = peak = 0
        for i, n in self.events:
            if i in freed:
                live += n
                peak = max(peak, live)
        return peak, sum(n for i, n in self.events if n > 0 and i not in freed)


class _Slice:
    def __init__(self, log: ReadLog, name: str, handle):
        self.log, self.name, self.handle = log, name, handle

    def get_shape(self):
        return self.handle.get_shape()

    def __getitem__(self, rows: slice):
        return self.log.took(self.name, [rows.start, rows.stop], self.handle[rows])


class _Shard:
    def __init__(self, log: ReadLog, handle):
        self.log, self.handle = log, handle

    def __enter__(self):
        self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.handle.keys()

    def get_tensor(self, name: str):
        return self.log.took(name, None, self.handle.get_tensor(name))

    def get_slice(self, name: str):
        return _Slice(self.log, name, self.handle.get_slice(name))


def model_bytes(model) -> dict:
    """Bytes of each routed-expert stack (by module name) and of every other parameter / buffer (each once)."""
    stacks = {name: m for name, m in model.named_modules() if isinstance(m, Experts)}
    in_stacks = {id(t) for m in stacks.values() for t in m.slot_tensors()}
    rest = {id(t): t for t in (*model.parameters(), *model.buffers()) if id(t) not in in_stacks}
    return {"experts": {name: sum(t.numel() * t.element_size() for t in m.slot_tensors()) for name, m in stacks.items()},
            "other": sum(t.numel() * t.element_size() for t in rest.values())}


def held_state(model) -> dict:
    """Host-resident engram tables, and the on-disk expert tensors kept beside the weights (keep_quantized)."""
    return {"host_tables": [str(m.weight.device) for m in model.modules() if isinstance(m, HostEngramEmbedding)],
            "quantized_experts": sum(len(per_expert) for m in model.modules() if isinstance(m, Experts)
                                     for per_expert in m.quantized.values())}


def main(out_path: str, spec: str) -> int:
    kw = json.loads(spec)
    prompts, max_tokens = kw.pop("prompts"), kw.pop("max_tokens")
    log = ReadLog()
    opened = loader.safe_open
    loader.safe_open = lambda path, **open_kw: _Shard(log, opened(path, **open_kw))
    rss = {}
    load = loader.CheckpointLoader.load

    def measured_load(self):          # the peak RSS's growth over the load itself (KiB on Linux)
        rss["before"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        load(self)
        gc.collect()
        rss["read_peak"], rss["kept"] = log.peaks()
        rss["growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss["before"]
    loader.CheckpointLoader.load = measured_load
    try:
        llm = LLM(model=kw.pop("model"), device="cpu", skip_tokenizer_init=True, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
    except DeepInferError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    mine = {"reads": log.reads, "peak_read_bytes": rss["read_peak"], "kept_read_bytes": rss["kept"],
            "model_bytes": model_bytes(llm.model),
            **held_state(llm.model),
            "load_rss_growth_kib": rss["growth"], "rss_before_load_kib": rss["before"]}
    ranks = [mine] if llm.ranks is None else llm.ranks.gather_objects(mine)
    if llm.ranks is None or llm.ranks.rank == 0:
        rows = [{"ids": o.outputs[0].token_ids,
                 "logprobs": [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                for o in outs]
        with open(out_path, "w") as f:
            json.dump({"rows": rows, "ranks": ranks}, f)
    return 0


if __name__ == "__main__":
    from worker_exit import run          # this folder is on sys.path: the script's own
    run(main)
