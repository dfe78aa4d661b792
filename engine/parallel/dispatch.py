"""MoE dispatch and combine: the rows of a batch permuted so each expert's rows are contiguous, and back.

One interface, `dispatch(x, weights, ids) -> Dispatched` and `combine(y_sorted, d) -> [N, D]`, between the
router (engine/models/common/moe.py) and the grouped expert op (kernels/experts.py). `LocalDispatch` is the one
implementation today: everything on this device, a stable sort of the N*k (row, slot) pairs by expert, static
shapes (N*k sorted rows, E+1 offsets) and no host sync, so a forward that uses it can be captured in a CUDA graph.

Where the later work plugs in:
  EPLB    `logical_to_physical` maps the router's logical expert ids to physical expert slots (replicas of hot
          experts; the stacked weights are then held in physical order). It is the identity today. A map with
          replicas would pick one replica per (row, slot) here; the combine order stays ascending *logical* id
          (slots are ordered by logical id before the map), so routing results do not depend on the placement.
  EP      engine/parallel/expert_parallel.py keeps this interface: `dispatch` brings each (row, slot) to the rank
          that holds its expert and returns that rank's rows grouped by its local experts; `combine` sends the
          outputs back and sums them per row in the same fixed order. The model only calls
          `moe.dispatch.dispatch / combine` (MoE.use_expert_parallel swaps the dispatcher and keeps its experts).

`record_routing()` collects the routed ids of each dispatch (for benchmarks: which experts a step touched)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from deepinfer.kernels.moe_combine import moe_combine
from deepinfer.kernels.routing import permute


@dataclass
class Dispatched:
    """One batch's rows grouped by expert. M = N * k sorted (row, slot) pairs; every tensor is on x's device.

    x        [M, D]  the rows, sorted by (physical) expert, stable: within an expert by row, then slot
    weights  [M]     their routing weights (the router's dtype)
    expert_ids [M]   int64, ascending: the expert of each sorted row
    offsets  [E+1]   int64: rows of expert e are offsets[e]:offsets[e+1] (device tensor; no host copy)
    order    [M]     flat source index row * k + slot of each sorted row (slots ordered by ascending logical id)
    inverse  [M]     sorted position of each flat (row, slot): the inverse permutation of `order`
    """

    x: torch.Tensor
    weights: torch.Tensor
    expert_ids: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor
    inverse: torch.Tensor
    n_rows: int
    top_k: int


class LocalDispatch:
    """Dispatch over the experts of this device. `n_experts`: physical experts (= logical, identity map)."""

    def __init__(self, n_experts: int, name: str | None = None):
        self.n_experts = n_experts
        self.name = name                     # a label for routing records (label_dispatchers sets module names)
        self.logical_to_physical: torch.Tensor | None = None   # EPLB hook: [E_logical] int64 -> physical slot

    def held_experts(self) -> list[int]:
        """The logical expert of each local slot: all of them, in order (the checkpoint loader reads these)."""
        return list(range(self.n_experts))

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        """x [N, D], weights [N, k], ids [N, k] (logical expert ids) -> the N*k rows grouped by expert."""
        record(self.name, ids)
        n, k = ids.shape
        # slots of each row in ascending logical id (the combine order), then stably grouped by physical expert
        expert_ids, offsets, order, inverse, weights, rows = permute(ids, weights, self.n_experts,
                                                                     self.logical_to_physical)
        return Dispatched(x=x.index_select(0, rows), weights=weights,
                          expert_ids=expert_ids, offsets=offsets, order=order, inverse=inverse, n_rows=n, top_k=k)

    def combine(self, y: torch.Tensor, d: Dispatched, shared: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y [M, D] (one output per sorted row) -> [N, D]: each row's k outputs summed one by one in ascending
        expert id, starting from the lowest (a fixed order whatever the batch), in >= fp32, then + shared [N, D]
        (the shared experts' output), cast to out_dtype (None: the >= fp32 sum, no shared). kernels/moe_combine.py."""
        dtype = out_dtype or torch.promote_types(y.dtype, torch.float32)
        return moe_combine(y, d.inverse, d.top_k, shared, dtype)


# ------------------------------------------------------------------------------------------- routing records

@dataclass
class RoutingRecord:
    """The routed ids of every dispatch while recording: `calls` in call order, (dispatcher name, ids [N, k]).
    The ids are the router's own device tensors (no copy, no sync). Python runs only on eager forwards: a CUDA
    graph replay dispatches without recording."""

    calls: list[tuple[str | None, torch.Tensor]] = field(default_factory=list)

    def add(self, name: str | None, ids: torch.Tensor) -> None:
        self.calls.append((name, ids.detach()))

    def touched(self, n_experts: int) -> torch.Tensor:
        """[calls, n_experts] bool on the ids' device: whether each call routed any row to each expert."""
        if not self.calls:
            return torch.zeros(0, n_experts, dtype=torch.bool)
        rows = []
        for _, ids in self.calls:
            hit = torch.zeros(n_experts, dtype=torch.bool, device=ids.device)
            rows.append(hit.index_fill_(0, ids.reshape(-1), True))
        return torch.stack(rows)

    def counts(self, n_experts: int) -> torch.Tensor:
        """[calls, n_experts] int64: (row, slot) pairs routed to each expert per call."""
        if not self.calls:
            return torch.zeros(0, n_experts, dtype=torch.long)
        return torch.stack([torch.zeros(n_experts, dtype=torch.long, device=ids.device)
                            .index_add_(0, ids.reshape(-1), torch.ones_like(ids.reshape(-1))) for _, ids in self.calls])


_RECORDERS: list[RoutingRecord] = []   # process-wide (the engine may run forwards on another thread); empty: no cost


_IDLE = [False]         # an idle step is running (its one token is no request's)


@contextlib.contextmanager
def idle_step():
    """What runs inside routes no request's token: routing records and load counters skip it (an expert-parallel
    rank's idle step, ModelRunner.idle_step)."""
    _IDLE[0] = True
    try:
        yield
    finally:
        _IDLE[0] = False


def counting() -> bool:
    """Whether dispatches now route real tokens (outside an idle step)."""
    return not _IDLE[0]


def record(name: str | None, ids: torch.Tensor) -> None:
    """A dispatcher's routed ids [N, k] into every open record_routing() (no cost when none is open)."""
    if counting():
        for rec in _RECORDERS:
            rec.add(name, ids)


@contextlib.contextmanager
def record_routing():
    """`with record_routing() as rec: ...` appends each dispatch's routed ids to rec.calls."""
    rec = RoutingRecord()
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


def label_dispatchers(model: torch.nn.Module) -> None:
    """Name every MoE's dispatcher after its module (`layers.3.ffn`), so routing records say which layer."""
    for name, module in model.named_modules():
        dispatcher = getattr(module, "dispatch", None)
        dispatcher = getattr(dispatcher, "inner", dispatcher)     # under a traffic counter (parallel/traffic.py)
        if isinstance(dispatcher, LocalDispatch):
            dispatcher.name = name
