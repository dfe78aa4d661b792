"""Preallocated state pools: every state kind of every sequence lives in one fixed tensor per kind.

From the model's StateSpec (cache/spec.py):
  rings[name]    [S, span', width]  per sequence slot; position p at row p % span' (span' = the declared span
                                    + the layout's ring_slack; `spans[name]` is the declared one)
  entries[name]  [NB, bt/ratio, w]  per block of `block_tokens` (bt) positions; entry j of a sequence (positions
                                    j*ratio .. j*ratio + ratio-1) lives at block_table[slot, j*ratio // bt],
                                    row j % (bt/ratio); every entry stream shares the one block table
  block_table    [S, max_blocks]    int32: a sequence's block k (positions k*bt .. (k+1)*bt - 1) -> pool block
  write_floor    [S]                int64: entries closed below it are not written (a prefix hit's shared blocks)
Slot 0 and block 0 are scratch: padding rows of a CUDA-graph batch and writes that must go nowhere land there,
and nothing real ever reads them. The pools know nothing of the model beyond the spec.

kv_cache_dtype="fp8" stores each kind that declares a `packed` record (the release's FP8 / FP4 cache layout) as
a kernels.kv_formats.PackedStore of uint8 records [..., record_bytes], which reads and writes as the values it
stands for; "auto" (the default) stores every kind in its dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.kernels.kv_formats import PackedStore, raw

from ..errors import DeepInferError
from .spec import StateSpec, torch_dtype

KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_dtype(value) -> None:
    """One line for a kv_cache_dtype that is not known (LLM checks it before the model loads, the pools again)."""
    if value not in KV_CACHE_DTYPES:
        raise DeepInferError(f"kv_cache_dtype={value!r} is not known; use one of {list(KV_CACHE_DTYPES)} ('fp8': the "
                             f"release's FP8 / FP4 cache records)")

MIN_BLOCK_TOKENS = 64
SCRATCH = 0


@dataclass(frozen=True)
class PoolLayout:
    """Sizes of one sequence's state, from the spec and the model dtype."""
    spec: StateSpec
    block_tokens: int
    dtype: torch.dtype            # the model's compute dtype
    kv_cache_dtype: str = "auto"  # "fp8": kinds with a packed record store it
    ring_slack: int = 0           # extra positions every ring holds (speculative decoding's longest verify row)

    @classmethod
    def of(cls, spec: StateSpec, dtype: torch.dtype, block_tokens: int | None = None,
           kv_cache_dtype: str = "auto", ring_slack: int = 0) -> "PoolLayout":
        """block_tokens: positions per block (default: MIN_BLOCK_TOKENS rounded up to a multiple of every entry
        ratio); a given value must be such a multiple. ring_slack: every ring holds span + ring_slack positions, so
        a verify row of up to ring_slack drafts never overwrites a position an accepted prefix still reads (its
        rejected positions' rows are rewritten later): rollback is then free (no snapshot)."""
        check_kv_cache_dtype(kv_cache_dtype)
        if kv_cache_dtype == "fp8" and not any(k.packed for k in spec.rings + spec.entries):
            raise DeepInferError("kv_cache_dtype='fp8': this model declares no FP8 cache layout; use 'auto'")
        lcm = spec.block_multiple()
        if block_tokens is None:
            block_tokens = lcm * math.ceil(MIN_BLOCK_TOKENS / lcm)
        elif block_tokens < 1 or block_tokens % lcm:
            raise DeepInferError(f"block_size={block_tokens} must be a positive multiple of {lcm} (every compress "
                                 f"ratio of this model divides a block)")
        if ring_slack < 0:
            raise DeepInferError(f"internal: ring_slack={ring_slack} must be >= 0")
        return cls(spec, block_tokens, dtype, kv_cache_dtype, ring_slack)

    @classmethod
    def for_model(cls, model, block_tokens: int | None = None, kv_cache_dtype: str = "auto",
                  ring_slack: int = 0) -> "PoolLayout":
        return cls.of(model.state_spec(), model.dtype, block_tokens, kv_cache_dtype, ring_slack)

    def ring_rows(self, ring) -> int:
        """Positions a ring pool holds: the declared span plus the slack."""
        return ring.span + self.ring_slack

    def packed(self, kind):
        """The record a kind is stored as (None: its dtype)."""
        return kind.packed if self.kv_cache_dtype == "fp8" else None

    def row_bytes(self, kind) -> int:
        """Bytes one position (ring) or entry holds."""
        fmt = self.packed(kind)
        if fmt is not None:
            return fmt.record_bytes
        return kind.width * torch.empty(0, dtype=torch_dtype(kind.dtype, self.dtype)).element_size()

    def bytes_per_slot(self) -> int:
        """Fixed bytes of one sequence: every ring."""
        return sum(self.ring_rows(r) * self.row_bytes(r) for r in self.spec.rings)

    def bytes_per_block(self) -> int:
        return sum(self.block_tokens // e.ratio * self.row_bytes(e) for e in self.spec.entries)

    def bytes_per_token(self) -> float:
        return self.bytes_per_block() / self.block_tokens

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens positions needs (0 when the model keeps no entries)."""
        return -(-num_tokens // self.block_tokens) if self.spec.entries else 0


class StatePools:
    """The pool tensors (on `device`) for `num_slots` sequences (+ scratch slot 0) and `num_blocks` entry blocks
    (+ scratch block 0); `max_blocks` = blocks of a max_model_len sequence; `snapshot_seats` copies of every ring
    (prefix caching's ring snapshots at block boundaries, cache/prefix.py)."""

    def __init__(self, layout: PoolLayout, num_slots: int, num_blocks: int, max_model_len: int,
                 device: torch.device, snapshot_seats: int = 0):
        self.layout, self.device = layout, device
        self.num_slots, self.num_blocks = num_slots, num_blocks
        self.block_tokens = layout.block_tokens
        self.max_blocks = max(layout.blocks_for(max_model_len), 1)
        S = num_slots + 1
        self.rings = {r.name: self._allocate(r, (S, layout.ring_rows(r))) for r in layout.spec.rings}
        self.spans = {r.name: r.span for r in layout.spec.rings}          # declared spans (the rings may hold more)
        self.entries = {e.name: self._allocate(e, (num_blocks + 1, layout.block_tokens // e.ratio))
                        for e in layout.spec.entries}
        self.block_table = torch.zeros(S, self.max_blocks, dtype=torch.int32, device=self.device)
        # [S] int64: a slot's entries below this position are a prefix hit's shared blocks, which no step writes
        # (its bounded replay runs those positions again for the rings only: cache/prefix.py)
        self.write_floor = torch.zeros(S, dtype=torch.long, device=self.device)
        self.snapshot_seats = snapshot_seats
        self.ring_snapshots = {r.name: self._allocate(r, (snapshot_seats, layout.ring_rows(r)))
                               for r in layout.spec.rings} if snapshot_seats else {}
        self._snapshot_of = {id(self.rings[n]): t for n, t in self.ring_snapshots.items()}

    def _allocate(self, kind, lead: tuple[int, int]):
        """[*lead, width] in the kind's dtype, or a PackedStore of records [*lead, record_bytes]."""
        fmt = self.layout.packed(kind)
        if fmt is None:
            return torch.zeros(*lead, kind.width, dtype=torch_dtype(kind.dtype, self.layout.dtype), device=self.device)
        return PackedStore(torch.zeros(*lead, fmt.record_bytes, dtype=torch.uint8, device=self.device), fmt,
                           self.layout.dtype)

    def nbytes(self) -> int:
        tensors = [raw(t) for t in (*self.rings.values(), *self.entries.values(), *self.ring_snapshots.values())] \
            + [self.block_table]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- a sequence's slot-fixed state: what speculative rollback and prefix caching restore ----
    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of every ring row of `slot` as stored (entries are append-only by position and need no copy)."""
        return {name: raw(ring)[slot].clone() for name, ring in self.rings.items()}

    def restore(self, slot: int, snapshot: dict[str, torch.Tensor]) -> None:
        if set(snapshot) != set(self.rings):
            raise DeepInferError("internal: a snapshot of another state layout was restored")
        for name, ring in self.rings.items():
            raw(ring)[slot].copy_(snapshot[name])

    def keep_rings(self, slot: int, seat: int) -> None:
        """Copy `slot`'s rings into snapshot seat `seat` (queued on the current stream: the state after the steps
        launched so far)."""
        torch._foreach_copy_([raw(t)[seat] for t in self.ring_snapshots.values()],
                             [raw(self.rings[n])[slot] for n in self.ring_snapshots])

    def snapshot_store(self, ring):
        """The snapshot seats [seats, span', width] of ring pool `ring` (one of self.rings' values)."""
        return self._snapshot_of[id(ring)]

    def put_rings(self, seat: int, slot: int) -> None:
        """Copy snapshot seat `seat` into `slot`'s rings."""
        torch._foreach_copy_([raw(self.rings[n])[slot] for n in self.ring_snapshots],
                             [raw(t)[seat] for t in self.ring_snapshots.values()])
