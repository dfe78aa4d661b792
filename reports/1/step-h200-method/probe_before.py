"""StepProbe for the pre-issue-12 engine (measurement shim, not part of the repo): the same interface as the
rebuilt engine's engine/runner/probe.py, over the old runner (paged decode step + DecodeGraphs) and the old
prefill (reference extend with the pools' load_state/store_state)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import DeepInferError


class StepProbe:
    def __init__(self, llm, batch_size: int, context_len: int, query_len: int = 1, seed: int = 0):
        self.llm, self.model, self.runner, self.manager = llm, llm.model, llm.runner, llm.manager
        self.pools = self.manager.pools
        if query_len > 1 and context_len > 0:
            raise DeepInferError("the old engine has no verify rows")
        self.rids = [f"step-probe-{i}" for i in range(batch_size)]
        for n, rid in enumerate(self.rids):
            if not self.manager.reserve(rid, context_len + query_len):
                self.close()
                raise DeepInferError(f"the state pools hold {n} of {batch_size} sequences")
        self.slots = [self.manager.slot(r) for r in self.rids]
        self.batch_size, self.context_len, self.query_len = batch_size, context_len, query_len
        self._fill(seed)
        dev = self.model.device
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, self.model.cfg.vocab_size, (batch_size * query_len,), generator=g).to(dev)
        self.slots_t = torch.tensor(self.slots, device=dev)
        self.positions_t = torch.full((batch_size,), context_len, device=dev, dtype=torch.long)
        self.prefill = context_len == 0 and query_len > 1
        self.ctx = self.runner._context_blocks(context_len + query_len)
        self.graphed = self.runner.graphs is not None and not self.prefill and batch_size <= self.runner.graphs.sizes[-1]
        n = batch_size * query_len
        self.inputs = SimpleNamespace(logit_rows=[n - 1] if self.prefill else list(range(n)))

    def _fill(self, seed):
        p = self.pools
        g = torch.Generator(device=p.device).manual_seed(seed)
        s = torch.tensor(self.slots, device=p.device)
        rings = list(p.window) + list(p.pending_kv.values()) + list(p.pending_score.values()) + \
            list(p.prev_a_kv.values()) + list(p.prev_a_score.values())
        for r in rings:
            r[s] = torch.randn(r[s].shape, generator=g, device=p.device).to(r.dtype)
        blocks = torch.tensor(sorted(b for r in self.rids for b in self.manager.owned[r][1]), dtype=torch.long,
                              device=p.device)
        for e in p.entries.values():
            if blocks.numel():
                e[blocks] = torch.randn(e[blocks].shape, generator=g, device=p.device).to(e.dtype)

    @property
    def state_bytes_read(self) -> int:
        lay = self.manager.layout
        return int(self.batch_size * (lay.bytes_per_slot() + (self.context_len + self.query_len) * lay.bytes_per_token()))

    @torch.inference_mode()
    def run(self, eager: bool = False):
        if self.prefill:
            st = self.pools.load_state(self.slots[0], 0, self.model.new_state())
            kw = {"last_only": True} if self.model.cfg.model_type == "deepseek_v41" else {}
            out = self.model.extend([self.tokens.cpu()], [st], **kw)[0][-1:]
            self.pools.store_state(self.slots[0], st, 0)
            return out.argmax(-1)
        logits = self.runner.graphs.run(self.slots_t, self.positions_t, self.tokens, self.ctx) \
            if self.graphed and not eager else None
        if logits is None:
            logits = self.runner.decode_step(self.model, self.pools, self.slots_t, self.positions_t, self.tokens,
                                             self.ctx)
        return logits.argmax(-1)

    def close(self):
        for r in self.rids:
            self.manager.release(r)
