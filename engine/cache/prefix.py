"""Prefix caching over the append-only state: content-hashed entry blocks shared between sequences, the
slot-fixed rings rebuilt by bounded replay (docs/prefix-cache.md).

A sequence's state (cache/spec.py) is per-block entries (compressed KV, index keys of positions k*bt ..
(k+1)*bt - 1 in its block k), which never change once those positions are computed, and per-slot rings (windows,
compressors' open windows, look-backs, draft rings), which every position rewrites. A block whose positions are
computed with committed tokens can be shared, read-only, by every later sequence with the same tokens up to its
end: its hash chains the hashes of the blocks before it and a salt (the model's config and dtype, its tokenizer
binding, the kernel table, the state dtype), so equal hashes mean equal prefixes under equal numerics; each block
keeps its token ids and its parent's hash, so a hit is verified token by token and a collision cannot mix
sequences. The hit granularity is one block (block_tokens positions, a multiple of every compression ratio).

Rings are not stored per block. A sequence that hits H positions replays [H - R, H): those positions run as a
prefill whose entry writes are dropped below the write floor H (the cached blocks hold those entries, and a shared
block is never written), and leave every ring as a full prefill would. R = max over rings of (rows + depth): the
replay's first rows read windows and look-backs the new slot does not hold, each sliding window above carries
that error W - 1 positions further (spec.Ring.depth), and R is the shortest replay whose errors all end before
the positions the rings keep. Hits of at most R positions are not taken (the replay would recompute them all).

Ring snapshots: where a sequence's computed positions ended exactly at a block boundary B (a step's piece or
decode row ended there), the manager copies its rings into a snapshot seat, published under the chain digest of
B once those blocks are registered. A hit whose chain passes a snapshot at B >= H - R starts at B instead: the
rings are copied in and [B, H) replays (nothing when B = H). A prefill piece may also take interior snapshots (its
forward writes the rings as after a boundary inside it into a seat: manager.interior_snapshots). Snapshot seats
are few (up to four per sequence seat), the least recently used goes first (a generating sequence keeps only its
newest decode-row snapshot), and a snapshot goes with its block.

Blocks: a block the cache knows has a reference count (sequences whose tables hold it); at zero it stays in the
pool, evictable, least recently used first, until an allocation needs it. Blocks are registered when a step's
results are applied (core._apply): their positions computed and their tokens committed (a verify row's rejected
positions are not). A sequence that computed a block another had already registered keeps its copy unregistered
(freed with it)."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    """A prefix a waiting sequence can start from: the cached blocks of its first `tokens` positions, the position
    its replay starts at, and the snapshot seat holding the rings there (None: the replay rebuilds them from
    tokens - R)."""
    blocks: tuple[int, ...]
    tokens: int
    replay_start: int
    snapshot: int | None = None


@dataclass
class _Block:
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


class PrefixCache:
    COUNTS = ("prefix_queried_tokens", "prefix_hit_tokens", "prefix_replayed_tokens", "prefix_evicted_blocks",
              "prefix_snapshot_hits", "prefix_cached_blocks", "prefix_replay_tokens", "prefix_snapshots")

    def __init__(self, block_tokens: int, replay_tokens: int, salt: bytes, snapshot_seats: int = 0):
        self.block_tokens, self.replay_tokens, self.salt = block_tokens, replay_tokens, salt
        self.blocks: dict[int, _Block] = {}          # pool block -> what it holds
        self.by_digest: dict[bytes, int] = {}
        self.refs: dict[int, int] = {}               # registered block -> sequences holding it
        self.idle: OrderedDict[int, None] = OrderedDict()   # registered, unreferenced: oldest use first
        self.retired: dict[int, int] = {}            # forgotten by clear() while held -> sequences still holding it
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()   # chain digest -> snapshot seat: oldest use first
        self.free_seats = list(range(snapshot_seats - 1, -1, -1))
        self.queried_tokens = self.hit_tokens = self.replayed_tokens = self.evicted_blocks = self.snapshot_hits = 0

    # ---- hashing ----
    def digest(self, parent: bytes | None, tokens) -> bytes:
        """The chained hash of one block of token ids after the block whose digest is `parent` (None: the first)."""
        h = hashlib.blake2b(self.salt if parent is None else parent, digest_size=16)
        h.update(array("q", tokens).tobytes())
        return h.digest()

    # ---- lookup ----
    def match(self, tokens: list[int], align: int | None = None) -> PrefixHit | None:
        """The longest cached prefix of `tokens` worth taking: whole blocks, leaving at least one position to
        compute (the sequence samples from it), longer than the replay or passing a snapshot; a snapshot counts
        only at a multiple of `align` (batch-invariant mode's piece grid)."""
        bt = self.block_tokens
        found, parent, snap = [], None, (0, None)
        for k in range((len(tokens) - 1) // bt):
            piece = tokens[k * bt:(k + 1) * bt]
            d = self.digest(parent, piece)
            block = self.by_digest.get(d)
            if block is None:
                break
            held = self.blocks[block]
            if held.parent != (parent or b"") or held.tokens != tuple(piece):     # a hash collision: not ours
                break
            found.append(block)
            parent = d
            if d in self.snapshots and (align is None or (k + 1) * bt % align == 0):
                snap = ((k + 1) * bt, self.snapshots[d])
        hit = len(found) * bt
        at, seat = snap
        if seat is not None and at >= hit - self.replay_tokens:
            return PrefixHit(tuple(found), hit, at, seat)
        if hit <= self.replay_tokens:
            return None
        return PrefixHit(tuple(found), hit, hit - self.replay_tokens)

    def chain(self, tokens: list[int], blocks: int) -> bytes | None:
        """The digest of the first `blocks` blocks of `tokens` (None for none)."""
        parent = None
        for k in range(blocks):
            parent = self.digest(parent, tokens[k * self.block_tokens:(k + 1) * self.block_tokens])
        return parent

    # ---- references ----
    def acquire(self, hit: PrefixHit) -> None:
        for block in hit.blocks:
            self.refs[block] += 1
            self.idle.pop(block, None)
        self.hit_tokens += hit.tokens
        self.replayed_tokens += hit.tokens - hit.replay_start
        if hit.snapshot is not None:
            self.snapshot_hits += 1
            self.snapshots.move_to_end(self.blocks[hit.blocks[hit.replay_start // self.block_tokens - 1]].digest)

    def release(self, block: int) -> bool:
        """A sequence lets go of `block`: True if the cache keeps it (registered, or retired and still held by
        another sequence), False if it is the caller's to free."""
        if block in self.retired:
            self.retired[block] -= 1
            if self.retired[block] == 0:
                del self.retired[block]
                return False
            return True
        if block not in self.blocks:
            return False
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.idle[block] = None
        return True

    def register(self, block: int, parent: bytes | None, tokens: list[int]) -> bytes:
        """A sequence's block, computed with committed `tokens` after the chain `parent`: cached unless an equal
        one already is (then the sequence keeps it unregistered). Returns its digest (the next block's parent)."""
        d = self.digest(parent, tokens)
        if d not in self.by_digest and block not in self.blocks:
            self.blocks[block] = _Block(d, parent or b"", tuple(tokens))
            self.by_digest[d] = block
            self.refs[block] = 1
        return d

    # ---- ring snapshots ----
    def free_seat(self) -> int | None:
        """A seat that holds no served snapshot (None: every seat serves one or is being written)."""
        return self.free_seats.pop() if self.free_seats else None

    def snapshot_seat(self) -> int | None:
        """A seat for a new snapshot: a free one, else the least recently used snapshot's (None: no seats)."""
        seat = self.free_seat()
        if seat is not None:
            return seat
        if self.snapshots:
            return self.snapshots.popitem(last=False)[1]
        return None

    def publish(self, digest: bytes, seat: int) -> bool:
        """The rings in `seat` are the state after the chain `digest`'s positions: serve them (True), or give the
        seat back (False) when that digest has a snapshot already or is not cached."""
        if digest in self.snapshots or digest not in self.by_digest:
            self.return_seat(seat)
            return False
        self.snapshots[digest] = seat
        return True

    def take_snapshot(self, digest: bytes | None) -> int | None:
        """Stop serving the snapshot at chain `digest` and hand its seat over (None: there is none now)."""
        return self.snapshots.pop(digest, None) if digest is not None else None

    def return_seat(self, seat: int) -> None:
        """A seat from snapshot_seat() that holds nothing to serve."""
        self.free_seats.append(seat)

    # ---- memory ----
    @property
    def evictable(self) -> int:
        return len(self.idle)

    def evict(self) -> int:
        """The least recently used unreferenced block, forgotten and handed to the caller."""
        block, _ = self.idle.popitem(last=False)
        self._forget(block)
        self.evicted_blocks += 1
        return block

    def clear(self) -> list[int]:
        """Forget every block (the model changed under them); returns the unreferenced ones, now free. Referenced
        ones stay with the sequences holding them, retired: never matched again, freed by their last release."""
        free = list(self.idle)
        self.free_seats.extend(self.snapshots.values())
        self.snapshots.clear()
        for block in list(self.blocks):
            if self.refs[block] > 0:
                self.retired[block] = self.retired.get(block, 0) + self.refs[block]
            self._forget(block)
        self.idle.clear()
        return free

    def _forget(self, block: int) -> None:
        held = self.blocks.pop(block)
        del self.by_digest[held.digest], self.refs[block]
        seat = self.snapshots.pop(held.digest, None)
        if seat is not None:
            self.return_seat(seat)

    def counts(self) -> dict:
        """EngineStats' prefix fields (COUNTS, in order): tokens queried / hit / replayed, blocks evicted and hits
        served from a snapshot since the engine was built, blocks cached now, the replay length, snapshots held."""
        return dict(zip(self.COUNTS, (self.queried_tokens, self.hit_tokens, self.replayed_tokens,
                                      self.evicted_blocks, self.snapshot_hits, len(self.blocks), self.replay_tokens,
                                      len(self.snapshots))))
