"""The state manager: sizes the pools from a memory budget once, then hands out sequence slots and entry blocks.

Budget: explicit `state_memory_bytes`, else on a GPU `gpu_memory_utilization` x total memory minus what the
model and a profiled forward already use (the engine does the profiling), else on a CPU enough for every seat
at `max_model_len` capped at DEFAULT_CPU_BYTES. The pools must hold at least one sequence of max_model_len;
seats (slots) are cut to what the budget leaves after that. A sequence owns one slot while it runs and
ceil(tokens / block_tokens) blocks; when a step needs blocks none are free, the scheduler preempts.
Snapshots keep a sequence's slot-fixed state at a position (speculative rollback, prefix caching)."""

from __future__ import annotations

import logging

import torch

from ..errors import DeepInferError
from .pools import PoolLayout, StatePools

log = logging.getLogger("deepinfer")
DEFAULT_CPU_BYTES = 4 << 30


class StateManager:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, memory_bytes: int | None,
                 block_size: int | None = None, kv_cache_dtype: str = "auto", ring_slack: int = 0):
        """model: anything with state_spec(), dtype and device (the cache knows the model by its spec only).
        ring_slack: extra positions per ring (PoolLayout; speculative decoding's longest draft)."""
        layout = PoolLayout.for_model(model, block_size, kv_cache_dtype, ring_slack)
        device = model.device
        self.layout, self.max_model_len = layout, max_model_len
        per_seq_blocks = max(layout.blocks_for(max_model_len), 1)
        table_bytes = 4 * per_seq_blocks                                    # the slot's block-table row
        full_seq = layout.bytes_per_slot() + per_seq_blocks * layout.bytes_per_block() + table_bytes
        scratch = layout.bytes_per_slot() + layout.bytes_per_block() + table_bytes     # slot 0 and block 0
        given = min(max_num_seqs * full_seq + scratch, DEFAULT_CPU_BYTES) if memory_bytes is None else memory_bytes
        memory_bytes = given - scratch
        if memory_bytes < full_seq:
            raise DeepInferError(
                f"the state budget ({given / 2**20:.1f} MiB) cannot hold one sequence of max_model_len="
                f"{max_model_len} ({full_seq / 2**20:.1f} MiB): raise state_memory_bytes / gpu_memory_utilization "
                f"or lower max_model_len")
        slot_bytes = layout.bytes_per_slot() + table_bytes
        slots = int(min(max_num_seqs, 1 + (memory_bytes - full_seq) // slot_bytes))
        blocks = (memory_bytes - slots * slot_bytes) // max(layout.bytes_per_block(), 1)
        blocks = int(min(blocks, slots * per_seq_blocks)) if layout.spec.entries else 0
        self.pools = StatePools(layout, slots, blocks, max_model_len, device)
        self.free_slots = list(range(slots, 0, -1))       # pop() hands out slot 1 first
        self.free_blocks = list(range(blocks, 0, -1))
        self.owned: dict[str, tuple[int, list[int]]] = {}      # request id -> (slot, blocks)
        self.snapshots: dict[str, tuple[int, dict]] = {}      # request id -> (num_tokens, ring copies)
        self.summary = (
            f"state pools ({self._storage_note(layout)}): "
            f"{layout.bytes_per_token():.0f} B/token in entries (blocks of {layout.block_tokens} "
            f"tokens), {layout.bytes_per_slot() / 2**20:.2f} MiB fixed per sequence, "
            f"{full_seq / 2**20:.1f} MiB per max_model_len={max_model_len} sequence; {slots} seats, "
            f"{blocks} blocks ({blocks * layout.block_tokens} tokens), {self.pools.nbytes() / 2**30:.3f} GiB")
        log.info(self.summary)

    @staticmethod
    def _storage_note(layout: PoolLayout) -> str:
        if layout.kv_cache_dtype != "fp8":
            return "model dtype"
        kinds = layout.spec.rings + layout.spec.entries
        packed = sum(layout.packed(k) is not None for k in kinds)
        return f"fp8 records: {packed} of {len(kinds)} state kinds"          # the rest: not KV, or no record fits

    @property
    def num_slots(self) -> int:
        return self.pools.num_slots

    def slot(self, rid: str) -> int:
        return self.owned[rid][0]

    def usage(self) -> dict:
        """Seats, blocks and bytes (EngineStats' state fields)."""
        return {"num_seats": self.num_slots, "free_seats": len(self.free_slots), "num_blocks": self.pools.num_blocks,
                "free_blocks": len(self.free_blocks), "block_tokens": self.layout.block_tokens,
                "state_bytes": int(self.pools.nbytes()), "state_summary": self.summary}

    def reserve(self, rid: str, num_tokens: int) -> bool:
        """Make `rid` own a slot and the blocks for num_tokens positions; False (nothing taken) if they
        are not free."""
        slot, blocks = self.owned.get(rid, (None, []))
        need = self.layout.blocks_for(num_tokens) - len(blocks)
        if (slot is None and not self.free_slots) or need > len(self.free_blocks):
            return False
        if slot is None:
            slot = self.free_slots.pop()
        if need > 0:
            new = [self.free_blocks.pop() for _ in range(need)]
            self.pools.block_table[slot, len(blocks):len(blocks) + need] = torch.tensor(
                new, dtype=torch.int32).to(self.pools.device, non_blocking=True)
            blocks = blocks + new
        self.owned[rid] = (slot, blocks)
        return True

    def release(self, rid: str) -> None:
        self.snapshots.pop(rid, None)
        slot, blocks = self.owned.pop(rid, (None, []))
        if slot is None:
            return
        self.free_blocks.extend(reversed(blocks))
        self.free_slots.append(slot)
        # NOTE: the table row keeps stale ids: the next owner overwrites the columns it uses, and entries past a
        # row's own count are never attended (hidden by position), so stale ids are never read.

    # ---- snapshots ----
    @torch.inference_mode()
    def snapshot(self, rid: str, num_tokens: int) -> None:
        """Keep `rid`'s slot-fixed state as it is after num_tokens positions (replaces an older snapshot)."""
        self.snapshots[rid] = (num_tokens, self.pools.snapshot(self.slot(rid)))

    def snapshot_unless_slack(self, rid: str, num_tokens: int, drafts: int) -> None:
        """Before a verify row of `drafts` drafts: rings with that much slack need no copy (a rejected position's
        row is rewritten before anything reads it), so any older snapshot is dropped; else snapshot."""
        if drafts <= self.layout.ring_slack:
            self.snapshots.pop(rid, None)
        else:
            self.snapshot(rid, num_tokens)

    @torch.inference_mode()
    def restore(self, rid: str, num_tokens: int) -> int:
        """Put back `rid`'s last snapshot; returns the number of positions it holds. Without one (the rings had
        slack for the verify row) nothing needs restoring: the state holds num_tokens valid positions."""
        if rid not in self.snapshots:
            return num_tokens
        num_tokens, snap = self.snapshots[rid]
        self.pools.restore(self.slot(rid), snap)
        return num_tokens
