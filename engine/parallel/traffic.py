"""Expert traffic: what the routers did during real steps, counted on the device.

`LLM(expert_traffic=True)` (every benchmark row asks for it) wraps each MoE layer's dispatcher in a CountingDispatch
before any CUDA graph is captured, so graph replays count too. Per layer it accumulates, over the forwards since
the last reset:
  load      [E]  (row, slot) pairs routed to each expert (from the dispatch's own offsets, no extra sort)
  touched        the sum over forwards of the distinct experts the forward routed to
  forwards       forwards counted
  expected       the sum over forwards of E (1 - (1 - k/E)^N), the distinct experts a uniform router touches at
                 that forward's N rows (in expectation), so steps of any size compare with one ratio
  rows           rows routed (graph padding included: padded rows are routed and read experts like any other)
A handful of small device ops per layer per forward and no host sync; `summary()` reads them (one sync)."""

from __future__ import annotations

import torch

from .dispatch import Dispatched, counting
from .expert_parallel import ExpertSlots, RankDispatched


def uniform_touched(n_experts: int, top_k: int, rows: float) -> float:
    """Distinct experts a uniform router (every token k distinct experts at random) touches at `rows` tokens."""
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** rows)


class CountingDispatch:
    """A dispatcher that counts what it dispatches into one layer's slots of an ExpertTraffic, then hands the
    work to the dispatcher it wraps (local today, expert-parallel later: the interface is the same)."""

    def __init__(self, inner, traffic: "ExpertTraffic", layer: int):
        self.inner, self.traffic, self.layer = inner, traffic, layer

    def __getattr__(self, name):          # n_experts, name, logical_to_physical ... of the wrapped dispatcher
        return getattr(self.inner, name)

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        d = self.inner.dispatch(x, weights, ids)
        if not counting():
            return d
        # an expert-parallel dispatch groups other ranks' rows too, over its own slots: count this rank's rows
        # by logical expert instead (per rank: each rank's counters see its own requests)
        n_experts = self.traffic.n_experts[self.layer]
        per_expert = torch.bincount(ids.reshape(-1), minlength=n_experts) if isinstance(d, RankDispatched) \
            else d.offsets.diff()
        self.traffic.count(self.layer, per_expert, ids.shape[0], ids.shape[1])
        return d

    def combine(self, *args, **kwargs):
        return self.inner.combine(*args, **kwargs)


class ExpertTraffic:
    """Device counters of every MoE layer's routed traffic (module doc). `names[i]`: layer i's MoE module name."""

    def __init__(self, names: list[str], n_experts: list[int], device: torch.device):
        self.names, self.n_experts = names, n_experts
        self.load = [torch.zeros(e, dtype=torch.long, device=device) for e in n_experts]
        self.sums = torch.zeros(len(names), 4, dtype=torch.float64, device=device)   # touched, forwards, exp, rows
        self.top_k = [0] * len(names)
        self.dispatchers: list = []          # the wrapped dispatcher of each layer (install)

    @classmethod
    def install(cls, model: torch.nn.Module) -> "ExpertTraffic":
        """Wrap the dispatcher of every module of `model` that has one (MoE layers, draft stages included). The
        counters belong to the model: engines built on one model (the draft bench's modes) share them, each
        zeroing them at its reset_stats, and a graph captured by any of them adds into the same tensors."""
        moes = [(n, m) for n, m in model.named_modules() if hasattr(m, "dispatch") and hasattr(m, "experts")]
        counted = {id(m.dispatch.traffic) for _, m in moes if isinstance(m.dispatch, CountingDispatch)}
        if counted and len(counted) == 1 and all(isinstance(m.dispatch, CountingDispatch) for _, m in moes):
            return moes[0][1].dispatch.traffic
        if counted:
            raise RuntimeError("expert traffic counters half-installed on this model")   # no code path does this
        device = next(model.parameters()).device
        traffic = cls([n for n, _ in moes], [m.dispatch.n_experts for _, m in moes], device)
        for i, (_, m) in enumerate(moes):
            m.dispatch = CountingDispatch(m.dispatch, traffic, i)
        traffic.dispatchers = [m.dispatch.inner for _, m in moes]
        return traffic

    def count(self, layer: int, counts: torch.Tensor, rows: int, top_k: int) -> None:
        """One forward's dispatch of `rows` rows (k each), `counts` [E] of their pairs per expert."""
        self.load[layer] += counts
        e = self.n_experts[layer]
        self.top_k[layer] = top_k
        sums = self.sums[layer]
        sums[0] += counts.gt(0).sum()
        # host constants as kernel scalars (no host-to-device copy, so a CUDA graph captures them per shape)
        sums[1] += 1.0
        sums[2] += uniform_touched(e, top_k, rows)
        sums[3] += float(rows)

    def reset(self) -> None:
        for t in self.load:
            t.zero_()
        self.sums.zero_()

    def loads(self) -> dict[str, dict]:
        """Per layer: `load` [E] (this rank's rows' pairs per logical expert), `rows` routed and `top_k` (0 before
        any forward), as host values (one sync): what a sum over expert-parallel ranks and their placement turn
        into pairs per rank."""
        rows = self.sums[:, 3].cpu().tolist()
        return {name: {"load": load.cpu().tolist(), "rows": int(r), "top_k": k}
                for name, load, r, k in zip(self.names, self.load, rows, self.top_k)}

    def expert_parallel_placement(self) -> dict[str, dict]:
        """Per expert-parallel layer (draft layers stay whole: not listed): `ranks` and `phy2log` (EPLB's physical
        slot -> logical expert now; None: slot = expert, rank r holds [r E/N, (r+1) E/N))."""
        out = {}
        for name, d in zip(self.names, self.dispatchers):
            if isinstance(d, ExpertSlots):
                out[name] = {"ranks": d.shard.size,
                             "phy2log": None if d.placement is None else d.placement.phy2log.cpu().tolist()}
        return out

    def summary(self) -> dict:
        """Host numbers per layer and in total (module doc); empty when nothing was counted."""
        sums = self.sums.cpu().tolist()
        layers = {}
        for name, (touched, forwards, expected, rows), load, e, k in zip(self.names, sums, self.load,
                                                                         self.n_experts, self.top_k):
            if not forwards:
                continue
            load = load.float()
            layers[name] = {"experts": e, "top_k": k, "forwards": int(forwards), "rows": int(rows),
                            "touched_per_forward": touched / forwards, "uniform_per_forward": expected / forwards,
                            "load_max_over_mean": float(load.max() / load.mean()) if load.sum() else None}
        return layers
