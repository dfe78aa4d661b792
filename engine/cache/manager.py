"""The state manager: sizes the pools from a memory budget once, then hands out sequence slots and entry blocks.

Budget: explicit `state_memory_bytes`, else on a GPU `gpu_memory_utilization` x total memory minus what the
model and a profiled forward already use (the engine does the profiling), else on a CPU enough for every seat
at `max_model_len` capped at DEFAULT_CPU_BYTES. The pools must hold at least one sequence of max_model_len;
seats (slots) are cut to what the budget leaves after that. A sequence owns one slot while it runs and
ceil(tokens / block_tokens) blocks; when a step needs blocks none are free, the scheduler preempts.
Snapshots keep a sequence's slot-fixed state at a position (speculative rollback).

With prefix caching (cache/prefix.py) a sequence's first blocks may be cached ones it shares, its computed blocks
are registered as the engine applies each step (cache_blocks), and blocks the cache holds unreferenced are free
space: an allocation takes a free block first, else evicts the least recently used cached one. Each seat then
brings up to SNAPSHOT_SEATS ring snapshot seats, from what the budget leaves beside the seats and one
max_model_len sequence's blocks (so a budget that holds one sequence without them still does): keep_boundaries
copies a sequence's rings where a step leaves it at a block boundary, interior_snapshots has a prefill piece's
forward write them as at interval boundaries inside it, cache_blocks publishes each once those positions' blocks
are registered, and a hit through a snapshot starts from it."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..errors import DeepInferError
from .pools import PoolLayout, StatePools
from .prefix import PrefixCache, PrefixHit

log = logging.getLogger("deepinfer")
DEFAULT_CPU_BYTES = 4 << 30
# positions between ring snapshots taken inside a prefill piece (rounded up to whole blocks): a later request that
# parts from a cached prompt anywhere replays at most about this much instead of R (~5k at the released widths)
PREFIX_SNAPSHOT_INTERVAL = 1024
# ring snapshot seats per sequence seat, shared (least recently used first) by the snapshots where rows end and
# the interior ones: enough for a chat to keep its conversations' last snapshots through more conversations than
# seats, and for a long prompt's interior ones; a V4.1-Flash seat is 5.4 MiB (about 28 blocks of entries)
SNAPSHOT_SEATS = 4
# the largest part of the entry blocks' bytes that ring snapshots may take when the budget has no bytes the blocks
# cannot use: 700 V4.1-Flash snapshots in 60 GB, at the cost of 6 % fewer cached positions
SNAPSHOT_SHARE = 16


class StateManager:
    def __init__(self, model, max_num_seqs: int, max_model_len: int, memory_bytes: int | None,
                 block_size: int | None = None, kv_cache_dtype: str = "auto", ring_slack: int = 0,
                 prefix_salt: bytes | None = None, idle_rings: tuple[str, ...] = (),
                 snapshot_interval: int = PREFIX_SNAPSHOT_INTERVAL):
        """model: anything with state_spec(), dtype and device (the cache knows the model by its spec only).
        ring_slack: extra positions per ring (PoolLayout; speculative decoding's longest draft). prefix_salt: turns
        prefix caching on, hashing blocks under this salt (what the state was computed by); idle_rings: rings no
        step writes (a drafter's when the engine does not draft), which a replay need not rebuild.
        snapshot_interval: positions between interior ring snapshots (0: snapshots only where rows end; an engine
        that drafts passes 0, its draft rings are written for each piece's last window only)."""
        layout = PoolLayout.for_model(model, block_size, kv_cache_dtype, ring_slack)
        device = model.device
        self.layout, self.max_model_len = layout, max_model_len
        per_seq_blocks = max(layout.blocks_for(max_model_len), 1)
        table_bytes = 4 * per_seq_blocks                                    # the slot's block-table row
        bt, ring_bytes, block_bytes = layout.block_tokens, layout.bytes_per_slot(), max(layout.bytes_per_block(), 1)
        self.snapshot_interval = -(-snapshot_interval // bt) * bt if prefix_salt is not None else 0
        snap = SNAPSHOT_SEATS if prefix_salt is not None and layout.spec.rings else 0
        slot_bytes = ring_bytes + table_bytes
        full_seq = slot_bytes + per_seq_blocks * block_bytes
        scratch = ring_bytes + block_bytes + table_bytes                    # slot 0 and block 0
        given = min(max_num_seqs * (full_seq + snap * ring_bytes) + scratch, DEFAULT_CPU_BYTES) \
            if memory_bytes is None else memory_bytes
        memory_bytes = given - scratch
        if memory_bytes < full_seq:
            raise DeepInferError(
                f"the state budget ({given / 2**20:.1f} MiB) cannot hold one sequence of max_model_len="
                f"{max_model_len} ({full_seq / 2**20:.1f} MiB): raise state_memory_bytes / gpu_memory_utilization "
                f"or lower max_model_len")
        slots = int(min(max_num_seqs, 1 + (memory_bytes - full_seq) // slot_bytes))
        rest = memory_bytes - slots * slot_bytes                            # entry blocks and ring snapshots
        # snapshot seats never cost a seat or the blocks of one max_model_len sequence: they take what the blocks
        # could not use (past every seat's max_model_len), else at most SNAPSHOT_SHARE of the blocks' bytes
        spare = max(rest - slots * per_seq_blocks * block_bytes,
                    min(rest // SNAPSHOT_SHARE, rest - per_seq_blocks * block_bytes)) if snap else 0
        seats = int(min(snap * slots, spare // ring_bytes)) if snap else 0
        blocks = (rest - seats * ring_bytes) // block_bytes
        blocks = int(min(blocks, slots * per_seq_blocks)) if layout.spec.entries else 0
        self.pools = StatePools(layout, slots, blocks, max_model_len, device, snapshot_seats=seats)
        self.free_slots = list(range(slots, 0, -1))       # pop() hands out slot 1 first
        self.free_blocks = list(range(blocks, 0, -1))
        self.owned: dict[str, tuple[int, list[int]]] = {}      # request id -> (slot, blocks)
        self.snapshots: dict[str, tuple[int, dict]] = {}      # request id -> (num_tokens, ring copies)
        self.prefix = None if prefix_salt is None else PrefixCache(
            layout.block_tokens, replay_tokens(layout, idle_rings), prefix_salt, self.pools.snapshot_seats)
        self.registered: dict[str, tuple[int, bytes | None]] = {}   # request id -> (blocks registered, their chain)
        self.floors: dict[str, int] = {}                     # request id -> its slot's write floor (the hit)
        self.queried: dict[str, int] = {}                    # request id -> tokens its last match looked up
        self.stale: set[str] = set()                         # request ids computed under a forgotten model
        self.kept: dict[str, list[tuple[int, int, bool]]] = {}   # request id -> (boundary, seat, decoding): rings
        #                                                        not published yet
        self.decode_snapshot: dict[str, bytes] = {}          # request id -> chain digest of its newest published
        #                                                        decode-row snapshot (the one a next turn resumes at)
        self.summary = (
            f"state pools ({self._storage_note(layout)}): "
            f"{layout.bytes_per_token():.0f} B/token in entries (blocks of {layout.block_tokens} "
            f"tokens), {layout.bytes_per_slot() / 2**20:.2f} MiB fixed per sequence, "
            f"{full_seq / 2**20:.1f} MiB per max_model_len={max_model_len} sequence; {slots} seats, "
            f"{blocks} blocks ({blocks * layout.block_tokens} tokens)"
            + (f", {seats} ring snapshot seats" if snap else "") + f", {self.pools.nbytes() / 2**30:.3f} GiB")
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
        """Seats, blocks and bytes (EngineStats' state fields), and the prefix cache's counts (None: off)."""
        counts = self.prefix.counts() if self.prefix is not None else dict.fromkeys(PrefixCache.COUNTS)
        return {"num_seats": self.num_slots, "free_seats": len(self.free_slots), "num_blocks": self.pools.num_blocks,
                "free_blocks": len(self.free_blocks), "block_tokens": self.layout.block_tokens,
                "state_bytes": int(self.pools.nbytes()), "state_summary": self.summary,
                "prefix_caching": self.prefix is not None, **counts}

    def match_prefix(self, rid: str, tokens: list[int], align: int | None = None) -> PrefixHit | None:
        """The cached prefix a sequence about to start could share, through snapshots at multiples of `align` only
        (nothing is taken: reserve(..., hit) takes it)."""
        if self.prefix is None or rid in self.owned:
            return None
        self.queried[rid] = len(tokens)              # counted once the sequence starts (reserve)
        return self.prefix.match(tokens, align)

    def reserve(self, rid: str, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Make `rid` own a slot and the blocks for num_tokens positions, its first ones `hit`'s shared blocks (a
        sequence that owns nothing yet); False (nothing taken) if they are not free."""
        slot, blocks = self.owned.get(rid, (None, []))
        shared = list(hit.blocks) if hit is not None and slot is None else []
        need = self.layout.blocks_for(num_tokens) - len(blocks) - len(shared)
        spare = len(self.free_blocks) + (self.prefix.evictable - sum(b in self.prefix.idle for b in shared)
                                         if self.prefix is not None else 0)
        if (slot is None and not self.free_slots) or need > spare:
            return False
        if slot is None:
            slot = self.free_slots.pop()
            if rid in self.queried:
                self.prefix.queried_tokens += self.queried.pop(rid)
        if shared:
            self.prefix.acquire(hit)
            self.registered[rid] = (len(shared), self.prefix.blocks[shared[-1]].digest)
            self.pools.write_floor[slot] = hit.tokens
            self.floors[rid] = hit.tokens
            if hit.snapshot is not None:
                self.pools.put_rings(hit.snapshot, slot)
        new = shared + [self._take_block() for _ in range(max(need, 0))]
        if new:
            self.pools.block_table[slot, len(blocks):len(blocks) + len(new)] = torch.tensor(
                new, dtype=torch.int32).to(self.pools.device, non_blocking=True)
            blocks = blocks + new
        self.owned[rid] = (slot, blocks)
        return True

    def _take_block(self) -> int:
        return self.free_blocks.pop() if self.free_blocks else self.prefix.evict()

    def cache_blocks(self, rid: str, num_tokens: int, tokens: Callable[[int, int], list[int]]) -> None:
        """`rid`'s positions 0 .. num_tokens-1 are computed with committed tokens, `tokens(start, end)` giving those
        of [start, end): register the blocks they fill (prefix caching; a no-op without it or for a sequence that
        holds no blocks now). Only the newly filled blocks' tokens are asked for: the engine calls this for every
        sampled row of every step, and a copy of the whole sequence there costs O(context) host time per row
        (docs/prefix-cache.md, "Host cost")."""
        if self.prefix is None or rid not in self.owned or rid in self.stale:
            return
        blocks = self.owned[rid][1]
        done, parent = self.registered.get(rid, (0, None))
        bt = self.layout.block_tokens
        full = min(num_tokens // bt, len(blocks))
        chain = {done: parent}
        if full > done:
            new = tokens(done * bt, full * bt)
            full = done + min(full - done, len(new) // bt)     # never past what the stream holds
            for k in range(done, full):
                at = (k - done) * bt
                parent = chain[k + 1] = self.prefix.register(blocks[k], parent, new[at:at + bt])
            if full > done:
                self.registered[rid] = (full, parent)
        waiting = []
        for at, seat, decoding in self.kept.pop(rid, ()):
            if chain.get(at // bt) is not None:
                if self.prefix.publish(chain[at // bt], seat) and decoding:
                    self._retire_decode_snapshot(rid)         # the newest one is served: the one before goes
                    self.decode_snapshot[rid] = chain[at // bt]
            elif at // bt > full:                          # not registered yet: the step is not applied
                waiting.append((at, seat, decoding))
            else:
                self.prefix.return_seat(seat)
        if waiting:
            self.kept[rid] = waiting

    def keep_boundaries(self, rows, align: int | None = None) -> None:
        """After a step's launch: each running sequence of `rows` (ScheduledRow) that feeds no drafts and ends at a
        block boundary (a multiple of `align` too, when given) at or past its hit has its rings copied to a
        snapshot seat, published by cache_blocks when those positions' blocks are registered. A replay's rings
        are exact only from the hit on (before it they lack what the replay has not yet covered). A sequence keeps
        one decode-row snapshot, its newest (where a next turn that resends the conversation parts from it): each
        copy retires the previous one when it is published, and where no seat is free it goes into the previous
        one's seat, so a long generation never pushes other sequences' out (_kept_seat)."""
        if self.prefix is None or not self.pools.snapshot_seats:
            return
        bt = self.layout.block_tokens
        for row in rows:
            end = row.start + row.n
            if end % bt or (align and end % align) or not self._may_snapshot(row) \
                    or end < self.floors.get(row.request_id, 0):
                continue
            seat = self._kept_seat(row.request_id, end, decoding=self._decoding(row))
            if seat is None:
                return
            self.pools.keep_rings(self.slot(row.request_id), seat)

    def interior_snapshots(self, rows, align: int | None = None) -> dict[int, list[tuple[int, int]]]:
        """Before a step's launch: the ring snapshots its prefill pieces take inside themselves, slot -> [(B, seat)]
        (the forward writes the rings as they are after position B into the seat: ForwardBatch.ring_marks). B runs
        over the multiples of the snapshot interval at or past the row's hit, far enough into the piece that every
        ring row at B is the piece's own, short of its end (keep_boundaries takes that one). Published like
        keep_boundaries' copies, by cache_blocks."""
        if self.prefix is None or not self.snapshot_interval or not self.pools.snapshot_seats or align:
            return {}      # batch-invariant mode (align): pieces end on its grid, where keep_boundaries takes them
        step = self.snapshot_interval
        deepest = max(self.layout.ring_rows(r) for r in self.layout.spec.rings)
        marks: dict[int, list[tuple[int, int]]] = {}
        for row in rows:
            if not self._may_snapshot(row):
                continue
            first = max(row.start + deepest, self.floors.get(row.request_id, 0))
            for at in range(-(-first // step) * step, row.start + row.n, step):
                seat = self._kept_seat(row.request_id, at)
                if seat is None:
                    return marks
                marks.setdefault(self.slot(row.request_id), []).append((at, seat))
        return marks

    @staticmethod
    def _decoding(row) -> bool:
        """A decode row: it samples, and every position it feeds is past the prompt (a resumed sequence's pieces
        over its earlier outputs sample only at its last one)."""
        return row.num_logits > 0 and row.start >= len(row.prompt_ids)

    def _may_snapshot(self, row) -> bool:
        """Whether a row's rings may be snapshotted: it feeds no drafts, and its sequence runs under this model."""
        return not row.draft_ids and row.request_id in self.owned and row.request_id not in self.stale

    def _kept_seat(self, rid: str, at: int, decoding: bool = False) -> int | None:
        """A snapshot seat for `rid`'s rings at position `at`, held until cache_blocks publishes it (None: none). A
        free seat first; where none is free, a decode row's copy takes back the seat of the sequence's previous
        decode snapshot, before any other sequence's least recently used one. A decode copy in a free seat retires
        the previous one only once it is published itself (a copy never published, its sequence finished or
        preempted before the step was applied, leaves the previous one served)."""
        seat = self.prefix.free_seat()
        if seat is None and decoding:
            seat = self.prefix.take_snapshot(self.decode_snapshot.pop(rid, None))
        seat = self.prefix.snapshot_seat() if seat is None else seat
        if seat is not None:
            self.kept.setdefault(rid, []).append((at, seat, decoding))
        return seat

    def _retire_decode_snapshot(self, rid: str) -> None:
        seat = self.prefix.take_snapshot(self.decode_snapshot.pop(rid, None))
        if seat is not None:
            self.prefix.return_seat(seat)

    def _drop_kept(self, rid: str) -> None:
        for _, seat, _ in self.kept.pop(rid, ()):
            self.prefix.return_seat(seat)

    def forget_prefixes(self) -> None:
        """The model changed under the cached state (a rank view): no block may be served again, and the running
        sequences' blocks (computed by the old model) are never registered."""
        if self.prefix is not None:
            self.free_blocks.extend(self.prefix.clear())
            self.registered.clear()
            self.decode_snapshot.clear()
            self.stale.update(self.owned)
            for rid in list(self.kept):
                self._drop_kept(rid)

    def release(self, rid: str) -> None:
        self.snapshots.pop(rid, None)
        self.registered.pop(rid, None)
        self.queried.pop(rid, None)
        self.decode_snapshot.pop(rid, None)          # a finished sequence's last snapshot stays served
        self.stale.discard(rid)
        if self.prefix is not None:
            self._drop_kept(rid)
        slot, blocks = self.owned.pop(rid, (None, []))
        if slot is None:
            return
        # last block first: a chain's tail turns evictable before its head (a head serves more prefixes)
        cached = {b for b in reversed(blocks) if self.prefix.release(b)} if self.prefix is not None else set()
        self.free_blocks.extend(b for b in reversed(blocks) if b not in cached)
        if self.floors.pop(rid, None) is not None:
            self.pools.write_floor[slot] = 0
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


def replay_tokens(layout: PoolLayout, idle_rings: tuple[str, ...] = ()) -> int:
    """Positions a prefix hit replays (cache/prefix.py): the longest ring's rows plus its depth."""
    return max((layout.ring_rows(r) + r.depth for r in layout.spec.rings if r.name not in idle_rings), default=0)
