"""One rank of an expert-parallel engine on one device: what `deepinfer-bench step --ep N --rank R` times
(docs/parallel.md, "The one-GPU rank view").

Rank R of an EP-N engine holds its share of every MoE layer's routed experts (E/N slots, or its slots of an EPLB
placement), runs attention for its own batch, and its MoE layers compute the pairs routed to its slots: its own
rows' and those the N-1 other ranks send. `rank_view(model, ...)` makes a one-device model that rank: the MoE
layers keep rank R's experts and dispatch through `RankViewDispatch`, which adds the other ranks' pairs from a
routing pool (the model's own routing of other tokens, recorded on the whole model: [P, k] logical ids per layer;
other rank j's rows are the pool's block j of the batch's size, the same at every step of a batch size).

The dispatch is static, as a backend with device-side counts (NCCL's EP API, DeepEP's low-latency kernels) would
be: a fixed-capacity buffer of every own pair plus the other ranks' pairs for this rank, grouped by local slot on
the device (pairs held elsewhere sort last and are not computed), then the fixed-order combine; no host read, so
the step is a CUDA graph like the one-rank step. The exchange itself is left out, and `ExchangeStats` counts its
bytes (all-to-all: pairs out and outputs back) for a projection to price over a link. Own rows get the outputs of
the pairs computed here only (the rest would come back from other ranks): the view is true in time, not in
value. With N = 1 it is the one-rank forward (tested)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from deepinfer.kernels.precision import upcast

from ..errors import DeepInferError
from ..models.common.moe import expert_parallel_layers
from deepinfer.kernels.routing import permute

from .dispatch import Dispatched, record
from .expert_parallel import ExpertSlots, Placement, _combine_own


@dataclass
class Received:
    """The pairs the other ranks send this rank at one batch size (fixed for the view's pool)."""
    slots: torch.Tensor          # [m_o] int64 physical slots (this rank's)
    weights: torch.Tensor        # [m_o] fp32 routing weights (1/k: the values do not change the time)
    rows: torch.Tensor           # [m_o] int64: the own row standing in for the sender's row (same width)
    per_rank: torch.Tensor       # [N] int64: pairs every rank computes from the other ranks' rows


@dataclass
class ExchangeStats:
    """One layer's dispatch at one batch size, as rank R of N would see it."""
    pairs_per_rank: list[int]    # pairs each rank's experts compute (all ranks' rows)
    received: int                # pairs computed here (own rows' local pairs + the other ranks')
    bytes_sent: int              # all-to-all bytes this rank sends: rows out (dispatch) + outputs back (combine)
    bytes_received: int

    @property
    def balancedness(self) -> float:
        """Mean over max pairs per rank (1.0: every rank computes as many pairs)."""
        top = max(self.pairs_per_rank)
        return sum(self.pairs_per_rank) / len(self.pairs_per_rank) / top if top else 1.0


class RankViewDispatch(ExpertSlots):
    def __init__(self, n_experts: int, rank: int, size: int, pool: torch.Tensor, name: str | None = None,
                 placement: Placement | None = None):
        super().__init__(n_experts, rank, size, name, placement)
        self.pool = pool                                   # [P, k] logical ids of the pool's tokens
        self._received: dict[int, Received] = {}
        self.stats: dict[int, ExchangeStats] = {}          # batch rows -> the first dispatch's exchange

    def _others(self, n: int, k: int, device: torch.device) -> Received:
        """The pairs ranks j != R send here when each holds n rows: the pool's rows [i n, (i+1) n) for the i-th
        other rank, slots by rank j's replica choice (Placement.physical from row j, as the engine's ranks)."""
        got = self._received.get(n)
        if got is not None:
            return got
        others = [j for j in range(self.shard.size) if j != self.shard.rank]
        if self.pool.shape[0] < len(others) * n:
            raise DeepInferError(f"the routing pool holds {self.pool.shape[0]} rows; {len(others)} other ranks of "
                                 f"{n} rows need {len(others) * n}: record a larger pool")
        pool = self.pool.to(device)
        slots = torch.cat([self._physical(pool[i * n:(i + 1) * n], j) for i, j in enumerate(others)]
                          ) if others else pool.new_zeros(0, k)
        flat = slots.reshape(-1)
        mine = ((flat >= self.shard.first) & (flat < self.shard.first + self.shard.count)).nonzero().squeeze(1)
        per_rank = torch.bincount(flat // self.shard.count, minlength=self.shard.size).cpu()
        got = Received(flat[mine], torch.full((mine.numel(),), 1.0 / k, device=device), (mine // k) % n, per_rank)
        self._received[n] = got
        return got

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> Dispatched:
        """x [N, D], weights / ids [N, k] of this rank's rows -> the pairs of a fixed-capacity buffer (every own
        pair, then the other ranks' pairs for this rank) grouped by local slot on the device; own pairs held
        elsewhere sort last and are not computed. No host read: the step can be a CUDA graph (the other ranks'
        pairs of each batch size are found once, eagerly, before any capture)."""
        n, k = ids.shape
        others = self._others(n, k, x.device)
        weights, ids = self._sorted_slots(weights, ids)
        own = self._physical(ids).reshape(-1)                                # [N*k] in combine order
        slots = torch.cat([own, others.slots])
        rows = torch.cat([torch.arange(n * k, device=x.device) // k, others.rows])
        w = torch.cat([weights.reshape(-1), others.weights.to(weights.dtype)])
        local, offsets, order, inverse, w, _ = permute(slots.view(-1, 1), w.view(-1, 1), self.shard.count + 1,
                                                    self.bucket(x.device))
        if not _capturing(x):            # a boolean mask reads the host: traffic is recorded by the eager steps
            record(self.name, local[local < self.shard.count].view(-1, 1))   # the local slots this rank computes
            if n not in self.stats:
                self.stats[n] = self._exchange(n, k, own, others, x)
        return Dispatched(x=x.index_select(0, rows[order]), weights=w, offsets=offsets[:self.shard.count + 1],
                          expert_ids=local.clamp(max=self.shard.count - 1), order=order, inverse=inverse,
                          n_rows=n, top_k=k)

    def _exchange(self, n: int, k: int, own: torch.Tensor, others: Received, x: torch.Tensor) -> ExchangeStats:
        """The exchange this dispatch stands for (host reads: the first, eager call of a batch size)."""
        counts = torch.bincount(own // self.shard.count, minlength=self.shard.size).cpu()
        kept = int(counts[self.shard.rank])
        row = x.shape[1] * x.element_size() + 4 + 8         # a pair's row, its weight (fp32) and its slot (int64)
        out = x.shape[1] * 4                                # an output goes back in fp32 (the combine's upcast)
        arriving = others.slots.numel()
        return ExchangeStats((others.per_rank + counts).tolist(), kept + arriving,
                             bytes_sent=(n * k - kept) * row + arriving * out,
                             bytes_received=arriving * row + (n * k - kept) * out)

    def combine(self, y: torch.Tensor, d: Dispatched, shared: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y [M, D] (rows past the local slots' not computed) -> own rows [N, D]: the own pairs computed here,
        zeros where another rank's outputs would arrive, then the fixed-order combine."""
        pairs = d.n_rows * d.top_k
        mine = upcast(y).index_select(0, d.inverse[:pairs])                  # [N*k, D] flat (row, slot) order
        here = d.inverse[:pairs] < d.offsets[-1]
        return _combine_own(torch.where(here.unsqueeze(1), mine, 0.0), d.top_k, shared, out_dtype)


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass
class RankView:
    size: int
    rank: int
    dispatchers: dict[str, RankViewDispatch] = field(default_factory=dict)

    def exchange(self, rows: int) -> dict:
        """The step's exchange at `rows` rows per rank (after a forward of that size): per-layer pairs per rank and
        balancedness, this rank's received pairs and all-to-all bytes summed over layers."""
        layers = {name: d.stats[rows] for name, d in self.dispatchers.items() if rows in d.stats}
        if not layers:
            return {}
        bal = [s.balancedness for s in layers.values()]
        return {"size": self.size, "rank": self.rank, "dispatch": "alltoall (exchange not run)",
                "pairs_received": sum(s.received for s in layers.values()),
                "pairs_mean_rank": round(sum(sum(s.pairs_per_rank) / self.size for s in layers.values()), 2),
                "bytes_sent": sum(s.bytes_sent for s in layers.values()),
                "bytes_received": sum(s.bytes_received for s in layers.values()),
                "balancedness_mean": round(sum(bal) / len(bal), 4), "balancedness_min": round(min(bal), 4),
                "layers": {name: {"pairs_per_rank": s.pairs_per_rank, "balancedness": round(s.balancedness, 4)}
                           for name, s in layers.items()}}


@contextlib.contextmanager
def rank_view(model: torch.nn.Module, size: int, rank: int, pool: dict[str, torch.Tensor],
              placements: dict[str, Placement] | None = None, keep_whole: tuple[str, ...] = ()):
    """`with rank_view(model, N, R, pool) as view:` the model is rank R of EP-N (module docstring); on exit it
    holds every expert again and dispatches locally. pool: MoE name -> [P, k] logical ids; placements: MoE name
    -> an EPLB placement (None: slots are the logical experts)."""
    if not 0 <= rank < size:
        raise DeepInferError(f"--rank {rank}: an expert-parallel group of {size} ranks has ranks 0..{size - 1}")
    view, saved = RankView(size, rank), []
    try:
        for name, moe in expert_parallel_layers(model, keep_whole):
            if name not in pool:
                raise DeepInferError(f"the routing pool has no rows for MoE layer {name!r}: record it on this model")
            dispatcher = RankViewDispatch(moe.gate.n_experts, rank, size, pool[name], name,
                                          (placements or {}).get(name))
            saved.append((moe, moe.dispatch, moe.experts.stack()))
            _hold_shard(moe, dispatcher)
            view.dispatchers[name] = dispatcher
        yield view
    finally:
        for moe, dispatch, stack in saved:
            moe.experts.hold(stack)
            moe.dispatch = dispatch


def _hold_shard(moe, dispatcher: RankViewDispatch) -> None:
    """The MoE holds the dispatcher's slots: without EPLB a contiguous range of the whole stack, held as views (no
    copy: the view gives the whole stack back on exit, so a released-width model fits once); with EPLB's replicas
    a copy (Experts.keep)."""
    held = dispatcher.held_experts()
    if held != list(range(held[0], held[0] + len(held))):
        moe.use_expert_parallel(dispatcher)
        return
    moe.experts.hold({n: t[held[0]:held[0] + len(held)] for n, t in moe.experts.stack().items()})
    dispatcher.slot_tensors = moe.experts.slot_tensors
    moe.dispatch = dispatcher
