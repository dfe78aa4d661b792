"""Expert parallelism: rank r of N holds routed experts [r*E/N, (r+1)*E/N) of every MoE layer; the dispatcher brings
it the (row, slot) pairs routed to them from every rank and sends the outputs back.

Both backends keep engine/parallel/dispatch.py's interface and its fixed combine order: each rank sums its own
rows' k expert outputs one by one in ascending expert id, exactly as LocalDispatch does, so in batch-invariant
mode (fixed row tiles, engine/models/common/moe.py) a DP x EP run is bitwise the one-rank run.

  allgather  every rank gathers every rank's rows (padded to the largest batch), computes the pairs routed to its
             experts, and a sum over ranks (reduce-scatter) hands each rank the outputs of its own pairs. Exactly
             one rank contributes each pair (the others add zeros), so the sum is exact. vLLM's and SGLang's
             default on Hopper; the traffic is every rank's rows to every rank.
  alltoall   each pair goes only to the rank that holds its expert (all_to_all_single with split sizes read on the
             host), and its output comes back the same way: the traffic is the routed pairs only.

Both read one host value per layer (the largest batch, or the split sizes), so an EP step runs eagerly; NCCL's EP
API or DeepEP kernels (device-side counts, CUDA graphs) would be a third backend here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepinfer.kernels.moe_combine import moe_combine
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.routing import permute

from ..errors import DeepInferError
from .dispatch import Dispatched, counting, record
from .ranks import BUILT_DISPATCH, Ranks


@dataclass
class ExpertShard:
    """Which physical expert slots of a layer this rank holds: [first, first + count) of n_physical. Without EPLB
    the slots are the logical experts; with it (`placement`) slot p holds logical expert phy2log[p], and a hot
    expert has several slots (replicas) across ranks."""
    n_physical: int
    rank: int
    size: int

    @property
    def count(self) -> int:
        return self.n_physical // self.size

    @property
    def first(self) -> int:
        return self.rank * self.count

    def bucket_of(self, device: torch.device) -> torch.Tensor:
        """[P + 1] int64: physical slot -> local slot index, count for slots held elsewhere (and for the pad id P):
        a bucket the experts never compute."""
        ids = torch.arange(self.n_physical + 1, device=device)
        local = ids - self.first
        return torch.where((local >= 0) & (local < self.count), local, torch.full_like(ids, self.count))


@dataclass
class Placement:
    """One layer's EPLB placement (engine/parallel/eplb.py): phy2log [P], log2phy [E, R] (-1 padded), counts [E]."""
    phy2log: torch.Tensor
    log2phy: torch.Tensor
    counts: torch.Tensor

    def physical(self, ids: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Logical ids [N, k] -> physical slots [N, k]: row first_row + i's pair takes replica (first_row + i) mod
        count (the replicas hold the same weights, so which one computes a row does not change it; first_row
        offsets each rank's rows, so ranks of one or two decode rows still spread over the replicas)."""
        rows = torch.arange(first_row, first_row + ids.shape[0], device=ids.device).unsqueeze(1)
        return self.log2phy[ids, rows % self.counts[ids]]

    def to(self, device: torch.device) -> "Placement":
        return Placement(self.phy2log.to(device), self.log2phy.to(device), self.counts.to(device))


def check_expert_split(n_experts: int, size: int, what: str = "a MoE layer") -> None:
    if n_experts % size:
        raise DeepInferError(f"enable_expert_parallel splits {what}'s {n_experts} routed experts over "
                             f"data_parallel_size={size} ranks: use a size that divides {n_experts}")


@dataclass
class RankDispatched(Dispatched):
    """Dispatched rows of this rank's experts; order / inverse index the pairs the dispatcher moved."""
    pairs: int = 0                 # pairs the sorted list spans (the gathered or received ones)
    rows_per_rank: int = 0         # allgather: the padded batch of every rank
    send: torch.Tensor | None = None       # alltoall: this rank's pairs in destination order (flat indices)
    send_splits: list | None = None
    recv_splits: list | None = None


class ExpertSlots:
    """What every expert-parallel dispatcher shares: rank `rank` of `size` holds physical slots `shard` of a layer
    of n_experts logical experts (under `placement`, EPLB's), maps logical ids to slots and groups its pairs."""

    def __init__(self, n_experts: int, rank: int, size: int, name: str | None = None,
                 placement: Placement | None = None):
        n_physical = n_experts if placement is None else len(placement.phy2log)
        check_expert_split(n_physical, size)
        self.n_experts, self.name, self.placement = n_experts, name, placement
        self.shard = ExpertShard(n_physical, rank, size)
        self._bucket = None
        self.step_load: torch.Tensor | None = None    # [E] own rows' pairs per logical expert (parallel/balancer.py)
        self.slot_tensors = lambda: []                # the held slots' stacked weights (MoE.use_expert_parallel)

    def _count(self, ids: torch.Tensor) -> None:
        record(self.name, ids)
        if self.step_load is not None and counting():
            flat = ids.reshape(-1)
            self.step_load.index_add_(0, flat, torch.ones_like(flat))

    def held_experts(self) -> list[int]:
        """The logical expert of each local slot."""
        slots = range(self.shard.first, self.shard.first + self.shard.count)
        return list(slots) if self.placement is None else [int(self.placement.phy2log[p]) for p in slots]

    def _physical(self, ids: torch.Tensor, first_row: int | None = None) -> torch.Tensor:
        """Logical ids [N, k] -> physical slots; first_row: the rows' first index in the replica choice (this
        rank's own rows start at its rank)."""
        if self.placement is None:
            return ids
        if self.placement.log2phy.device != ids.device:
            self.placement = self.placement.to(ids.device)
        return self.placement.physical(ids, self.shard.rank if first_row is None else first_row)

    def bucket(self, device: torch.device) -> torch.Tensor:
        if self._bucket is None or self._bucket.device != device:
            self._bucket = self.shard.bucket_of(device)
        return self._bucket

    def _local(self, x_source: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, k: int) -> tuple:
        """Pairs' physical slots / weights [M] (flat: pair i's row is x_source[i // k]) -> this rank's pairs
        grouped by local slot: (x [m, D], weights [m], local slot ids [m], offsets [count + 1], order [M],
        inverse [M]). The pairs go in as one column, so no pair moves within its row."""
        count = self.shard.count
        local, offsets, order, inverse, w, _ = permute(slots.view(-1, 1), weights.reshape(-1, 1), count + 1,
                                                    self.bucket(slots.device))
        m = int(offsets[count])                      # host read: this rank's pair count
        return x_source.index_select(0, order[:m] // k), w[:m], local[:m], offsets[:count + 1], order, inverse

    def _destinations(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple:
        """This rank's rows' pairs -> (weights [N, k] and physical slots [N*k] in combine order, send [N*k]: the
        flat pairs sorted by the rank holding their slot (stable), counts [ranks]: pairs per destination)."""
        weights, ids = self._sorted_slots(weights, ids)
        flat_ids = self._physical(ids).reshape(-1)
        dest, send = (flat_ids // self.shard.count).sort(stable=True)
        return weights, flat_ids, send, torch.bincount(dest, minlength=self.shard.size)

    @staticmethod
    def _sorted_slots(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's slots in ascending expert id (the combine order)."""
        ids, perm = ids.sort(dim=1, stable=True)
        return weights.gather(1, perm), ids


class _ExpertParallel(ExpertSlots):
    """A dispatcher that moves rows between the ranks of `ranks`."""

    def __init__(self, n_experts: int, ranks: Ranks, name: str | None = None, placement: Placement | None = None):
        super().__init__(n_experts, ranks.rank, ranks.size, name, placement)
        self.ranks = ranks


class AllGatherDispatch(_ExpertParallel):
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> RankDispatched:
        """x [N, D], weights / ids [N, k] of this rank's rows -> every rank's pairs routed to this rank's experts."""
        self._count(ids)
        n, k = ids.shape
        weights, ids = self._sorted_slots(weights, ids)
        n_max = self.ranks.max(n)
        pad = n_max - n
        own = (F.pad(x, (0, 0, 0, pad)), F.pad(weights, (0, 0, 0, pad)),
               F.pad(self._physical(ids), (0, 0, 0, pad), value=self.shard.n_physical))   # pads: never computed
        xs, ws, ids_all = (self.ranks.all_gather(t) for t in own)
        xl, wl, el, offsets, order, inverse = self._local(xs, ids_all.reshape(-1), ws.reshape(-1), k)
        return RankDispatched(x=xl, weights=wl, expert_ids=el, offsets=offsets, order=order, inverse=inverse,
                              n_rows=n, top_k=k, pairs=ids_all.numel(), rows_per_rank=n_max)

    def combine(self, y: torch.Tensor, d: RankDispatched, shared: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """y [m, D] this rank's experts' outputs -> this rank's rows [N, D], summed in ascending expert id."""
        full = upcast(y).new_zeros(d.pairs, y.shape[1])
        full[: y.shape[0]] = upcast(y)
        per_pair = full.index_select(0, d.inverse)             # [R * n_max * k, D]: (rank, row, slot) order
        mine = self.ranks.reduce_scatter(per_pair)
        return _combine_own(mine[: d.n_rows * d.top_k], d.top_k, shared, out_dtype)


class AllToAllDispatch(_ExpertParallel):
    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> RankDispatched:
        self._count(ids)
        n, k = ids.shape
        weights, flat_ids, send, counts = self._destinations(weights, ids)
        recv_counts = self.ranks.all_to_all(counts, self.ranks.size)
        send_splits, recv_splits = counts.tolist(), recv_counts.tolist()    # host read: the split sizes
        received = sum(recv_splits)
        xr, wr, ir = (self.ranks.all_to_all(t, received, send_splits, recv_splits)
                      for t in (x.index_select(0, send // k), weights.reshape(-1)[send], flat_ids[send]))
        xl, wl, el, offsets, order, inverse = self._local(xr, ir, wr, 1)
        return RankDispatched(x=xl, weights=wl, expert_ids=el, offsets=offsets, order=order, inverse=inverse,
                              n_rows=n, top_k=k, pairs=received, send=send, send_splits=send_splits,
                              recv_splits=recv_splits)

    def combine(self, y: torch.Tensor, d: RankDispatched, shared: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        received = upcast(y).index_select(0, d.inverse)          # [received, D] in arrival order (every pair local)
        back = self.ranks.all_to_all(received, d.n_rows * d.top_k, d.recv_splits, d.send_splits)
        mine = torch.empty_like(back).index_copy_(0, d.send, back)          # flat (row, slot) order
        return _combine_own(mine, d.top_k, shared, out_dtype)


DISPATCHERS = {"allgather": AllGatherDispatch, "alltoall": AllToAllDispatch}
assert tuple(DISPATCHERS) == BUILT_DISPATCH


def _combine_own(pairs: torch.Tensor, k: int, shared: torch.Tensor | None, out_dtype: torch.dtype | None):
    """pairs [N*k, D] in flat (row, slot) order, slots in ascending expert id -> [N, D] (the LocalDispatch sum)."""
    dtype = out_dtype or torch.promote_types(pairs.dtype, torch.float32)
    return moe_combine(pairs, torch.arange(pairs.shape[0], device=pairs.device), k, shared, dtype)
