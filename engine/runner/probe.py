"""StepProbe: one engine step of a chosen shape over synthetic state, for step benchmarks (deepinfer-bench step).

    probe = StepProbe(llm, batch_size=64, context_len=8192)   # 64 sequences whose state holds 8192 positions
    probe.run()                                               # one step: forward + logits + greedy pick
    probe.close()

Decode (query_len 1) and verify (query_len q+1) shapes run exactly as the engine runs them (the runner's
run_shape): a CUDA-graph replay where the engine captures graphs, else the eager forward, the model's draft
rings kept where the engine keeps them. A prefill shape is batch_size=1, context_len=0, query_len=T (eager,
logits of the last row only, truncated where the engine would truncate it). The state is random (rings and
owned entry blocks filled with normal noise of the compute dtype, look-back ids 0): timing does not depend on it,
routing does only as any random input's would. run() does not synchronise the host; the caller times it."""

from __future__ import annotations

import torch

from deepinfer.kernels.sampling import gumbel_argmax
from deepinfer.kernels.table import use

from ..errors import DeepInferError
from .inputs import StepInputs

FILL_BLOCKS = 256          # entry blocks filled with random values at a time


class StepProbe:
    def __init__(self, llm, batch_size: int, context_len: int, query_len: int = 1, seed: int = 0):
        engine = llm.engine
        self.model, self.runner, self.manager, self.kernels = llm.model, engine.runner, engine.manager, engine.kernels
        if batch_size < 1 or context_len < 0 or query_len < 1:
            raise DeepInferError(f"a step needs batch >= 1, context >= 0 and query length >= 1; got {batch_size}, "
                                 f"{context_len}, {query_len}")
        if context_len + query_len > self.manager.max_model_len:
            raise DeepInferError(f"context {context_len} + {query_len} new positions exceed max_model_len="
                                 f"{self.manager.max_model_len}; build the engine with a larger max_model_len")
        self.rids = [f"step-probe-{i}" for i in range(batch_size)]
        seated = seat_random(self.manager, self.rids, context_len + query_len, seed)
        if seated < batch_size:
            self.close()
            raise DeepInferError(f"the state pools hold {seated} of {batch_size} sequences of {context_len + query_len}"
                                 f" positions; raise gpu_memory_utilization / state_memory_bytes or lower the batch")
        self.slots = [self.manager.slot(r) for r in self.rids]
        self._seeded = [self.runner.pools.snapshot(s) for s in self.slots]     # rewind()'s state
        self.batch_size, self.context_len, self.query_len = batch_size, context_len, query_len
        dev = self.model.device
        g = torch.Generator(device="cpu").manual_seed(seed)
        tokens = torch.randint(0, self.model.cfg.vocab_size, (batch_size * query_len,), generator=g).to(dev)
        n = batch_size * query_len
        prefill = context_len == 0 and query_len > 1
        self.inputs = StepInputs.shaped(self.slots, [context_len] * batch_size, [query_len] * batch_size, tokens,
                                        [n - 1] if prefill else None)
        self.graphed = self.runner.graphs is not None and not prefill and batch_size <= self.runner.graphs.sizes[-1]
        self._no_noise = torch.zeros(1, dtype=torch.long, device=dev)      # seeds / positions the draw ignores

    @property
    def state_bytes_read(self) -> int:
        """Per sequence: every ring (windows, open-window buffers, look-back) and every entry stream up to the
        context (an upper bound: sparse attention reads only its top-k kv entries, an indexer every key)."""
        lay = self.manager.layout
        per_seq = lay.bytes_per_slot() + (self.context_len + self.query_len) * lay.bytes_per_token()
        return int(self.batch_size * per_seq)

    @property
    def logit_rows(self) -> int:
        """Rows whose logits a step computes: every row, or the last one of a prefill."""
        return len(self.inputs.logit_rows)

    @torch.inference_mode()
    def run(self, eager: bool = False) -> torch.Tensor:
        """One step; returns the greedy picks [rows] (on the device). eager: skip the graph replay, so Python
        runs (a routing recorder sees the step)."""
        with use(self.kernels):
            logits = self.runner.run_shape(self.inputs, graphed=not eager)
            # the engine's own draw op (no noise rows: the plain argmax, ties to the lowest id), so the step times
            # the pick the sampler runs, not torch's one-block-a-row argmax (35-38 us at 1-16 rows of 129k ids)
            return gumbel_argmax(logits, None, self._no_noise, self._no_noise)

    @torch.inference_mode()
    def run_static(self) -> torch.Tensor:
        """One step of the forward a CUDA graph of this shape captures (the runner's static step: uniform segments of
        query_len rows), run eagerly on any device; returns its logits. What a graph replay runs, for counting its ops
        on the CPU (deepinfer-bench ops --graph)."""
        dev = self.model.device
        slots = torch.tensor(self.slots, dtype=torch.long, device=dev)
        starts = torch.full((self.batch_size,), self.context_len, dtype=torch.long, device=dev)
        runner = self.runner
        with use(self.kernels):
            return runner.static_logits(slots, starts, None, self.query_len, self.batch_size * self.query_len,
                                        runner._context_blocks(self.context_len + self.query_len),
                                        runner.keep_draft_rings, self.inputs.tokens)

    def rewind(self) -> None:
        """Give the probe's slots back the ring state they were seeded with. A step writes its positions' rows, and
        a ring of n rows holding positions p-n..p-1 loses p-n to the write of p: a token look-back ring (n rows read
        as the n positions before p) then sees another token when the same position runs again. Steps compared for their
        values rewind first; timed steps need not (the values do not change the time)."""
        for slot, rows in zip(self.slots, self._seeded):
            self.runner.pools.restore(slot, rows)

    def close(self) -> None:
        for rid in self.rids:
            self.manager.release(rid)


def seat_random(manager, rids: list[str], num_tokens: int, seed: int = 0) -> int:
    """Give each request id a slot and the blocks of num_tokens positions, in order, and fill their state with
    normal noise of its dtype (rings; the owned entry blocks); stops at the first that does not fit. Returns how
    many were seated (the caller releases them)."""
    seated = 0
    for rid in rids:
        if not manager.reserve(rid, num_tokens):
            break
        seated += 1
    if not seated:
        return 0
    pools = manager.pools
    g = torch.Generator(device=pools.device).manual_seed(seed)
    slots = torch.tensor([manager.slot(r) for r in rids[:seated]], device=pools.device)
    for ring in pools.rings.values():
        if ring.dtype.is_floating_point:
            shape = (slots.shape[0], *ring.shape[1:])
            ring[slots] = torch.randn(shape, generator=g, device=pools.device).to(ring.dtype)
    blocks = torch.tensor(sorted(b for r in rids[:seated] for b in manager.owned[r][1]), dtype=torch.long,
                          device=pools.device)
    for store in pools.entries.values():
        for part in blocks.split(FILL_BLOCKS):        # a packed store packs through fp32 temporaries: in parts
            shape = (part.shape[0], *store.shape[1:])
            store[part] = torch.randn(shape, generator=g, device=pools.device).to(store.dtype)
    return seated
