"""The block cache (engine/cache/prefix.py) and the state manager's side of it (engine/cache/manager.py): chained
hashes verified by tokens, references and least-recently-used eviction, forgetting, the tokens the engine's offer
of each row's blocks reads, and the one-decode-snapshot rule's seats (docs/prefix-cache.md). Whole engines with
hits: tests/test_prefix_cache.py."""

from __future__ import annotations

from types import SimpleNamespace

from deepinfer import SamplingParams
from deepinfer.cache.prefix import PrefixCache
from tests.test_prefix_cache import BT, HIT, _llm, _tokens


# ---------------------------------------------------------------------------------------------- the block cache

def test_blocks_chain_verify_and_evict_least_recently_used():
    cache = PrefixCache(block_tokens=4, replay_tokens=4, salt=b"model")
    toks = list(range(100, 113))                              # 3 whole blocks + 1
    parent = None
    for block, k in zip((7, 8, 9), range(3)):
        parent = cache.register(block, parent, toks[4 * k:4 * k + 4])
    hit = cache.match(toks)
    assert hit.blocks == (7, 8, 9) and hit.tokens == 12 and hit.replay_start == 8
    assert cache.match(toks[:12]).tokens == 8                # one position is always left to compute
    assert cache.match(toks[:5]) is None                     # 4 positions: not longer than the replay
    assert cache.match(toks[:4] + [1] + toks[5:]) is None    # parts inside the second block: 4, not > 4
    assert cache.match(toks[:8] + [1] + toks[9:]).blocks == (7, 8)
    assert PrefixCache(4, 4, b"another model").match(toks) is None        # the salt is part of every hash
    # references: the registering sequence holds each block; released, they become evictable, oldest first
    assert cache.evictable == 0
    for block in (9, 7, 8):
        assert cache.release(block)
    assert not cache.release(42)                              # never registered: the caller frees it
    assert [cache.evict() for _ in range(3)] == [9, 7, 8] and cache.evicted_blocks == 3
    assert cache.match(toks) is None and not cache.blocks


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    cache = PrefixCache(block_tokens=4, replay_tokens=0, salt=b"m")
    monkeypatch.setattr(cache, "digest", lambda parent, tokens: b"same")     # every block hashes alike
    cache.register(3, None, [1, 2, 3, 4])
    assert cache.match([9, 9, 9, 9, 9]) is None               # its tokens are checked, not only its hash
    assert cache.match([1, 2, 3, 4, 5]).blocks == (3,)


def test_a_second_copy_of_a_block_stays_its_owners():
    cache = PrefixCache(block_tokens=2, replay_tokens=0, salt=b"m")
    d = cache.register(1, None, [5, 6])
    assert cache.register(2, None, [5, 6]) == d and 2 not in cache.blocks
    assert not cache.release(2) and cache.release(1)



def _view(toks: list[int]):
    """The token accessor cache_blocks takes: tokens(start, end)."""
    return lambda start, end: toks[start:end]


def _held_twice(m, toks):
    """Sequence "a" computes `toks` and registers its blocks; "b" starts from a's cached prefix."""
    assert m.reserve("a", len(toks))
    m.cache_blocks("a", len(toks), _view(toks))
    hit = m.match_prefix("b", toks)
    assert hit is not None and m.reserve("b", len(toks), hit)
    return hit


def test_forgotten_blocks_stay_with_their_sharers_and_are_freed_once():
    m = _llm("deepseek_v4", True).engine.manager
    toks = _tokens(HIT + 1, 11)
    free = sorted(m.free_blocks)
    _held_twice(m, toks)
    m.forget_prefixes()
    assert not m.prefix.blocks and m.prefix.match(toks) is None
    m.cache_blocks("a", len(toks), _view(toks))               # computed by the old model: never registered again
    assert not m.prefix.blocks
    m.release("a")
    assert m.owned["b"][1][0] not in m.free_blocks            # b still reads the shared blocks
    m.release("b")
    assert sorted(m.free_blocks) == free                      # each block back exactly once


def test_a_released_chain_is_evicted_tail_first():
    m = _llm("deepseek_v4", True).engine.manager
    toks = _tokens(HIT + 1, 12)
    m.match_prefix("a", toks)
    assert m.reserve("a", len(toks))
    m.cache_blocks("a", len(toks), _view(toks))
    chain = m.owned["a"][1][:HIT // BT]
    m.release("a")
    assert not m.queried                                      # the lookup's count is dropped with the sequence
    assert [m.prefix.evict() for _ in chain] == chain[::-1]    # the head, shared by most prefixes, goes last


def test_each_committed_position_is_read_once_for_the_cache():
    """The engine offers every sampled row's blocks to the cache each step; the cache reads only the tokens of
    blocks newly filled, so its host time per step does not grow with the context (a whole-sequence copy per row
    per step cost O(context): docs/prefix-cache.md, "Host cost")."""
    llm = _llm("deepseek_v41", True)
    m, calls, asked = llm.engine.manager, [], {}
    real = m.cache_blocks

    def spy(rid, num_tokens, tokens):
        calls.append(rid)

        def read(start, end):
            asked.setdefault(rid, []).append((start, end))
            return tokens(start, end)
        real(rid, num_tokens, read)
    m.cache_blocks = spy
    outs = llm.generate([_tokens(40, 1), _tokens(40, 2)], SamplingParams(max_tokens=100, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 100 for o in outs)
    assert len(calls) >= 200                                  # every decode row of both sequences offered its blocks
    for ranges in asked.values():                             # read in order, each position once, whole blocks
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all((end - start) % BT == 0 and end > start for start, end in ranges)
        assert ranges[-1][1] == (40 + 100 - 1) // BT * BT      # every block the sequence filled, nothing after
    assert sum(len(r) for r in asked.values()) <= 2 * (140 // BT)


def _row(rid, prompt, end, n=1, sampled=True):
    """The fields of a ScheduledRow keep_boundaries reads: a row feeding positions end-n .. end-1."""
    return SimpleNamespace(request_id=rid, start=end - n, n=n, num_logits=int(sampled), prompt_ids=prompt,
                           draft_ids=())


def test_a_decode_snapshot_is_retired_only_by_a_published_one():
    """A sequence's next decode copy takes a free seat and retires its previous decode snapshot once published; a
    copy never published (the sequence finished before that step was applied) leaves the previous one served."""
    m = _llm("deepseek_v41", True).engine.manager
    free = len(m.prefix.free_seats)
    for rid, seed, applied in (("a", 60, False), ("b", 62, True)):
        prompt = _tokens(20, seed)
        toks = prompt + _tokens(2 * BT, seed + 1)              # prompt + outputs
        assert m.reserve(rid, 3 * BT + 1)
        m.keep_boundaries([_row(rid, prompt, 2 * BT)])
        m.cache_blocks(rid, 2 * BT, _view(toks))
        first = m.prefix.chain(toks, 2)
        assert m.decode_snapshot[rid] == first and first in m.prefix.snapshots
        m.keep_boundaries([_row(rid, prompt, 3 * BT)])        # the next copy: a free seat, the first still served
        assert first in m.prefix.snapshots and len(m.prefix.free_seats) == free - 2
        if applied:
            m.cache_blocks(rid, 3 * BT, _view(toks))
            assert first not in m.prefix.snapshots and m.prefix.chain(toks, 3) in m.prefix.snapshots
        m.release(rid)
        assert first in m.prefix.snapshots or applied
        assert len(m.prefix.free_seats) == free - 1           # one snapshot served per finished sequence
        free -= 1


def test_only_sampling_rows_are_decode_rows():
    """A resumed sequence recomputes its earlier outputs in pieces that sample nothing: their copies are kept as a
    prefill's (beside the decode snapshot), never counted as decode ones."""
    m = _llm("deepseek_v41", True).engine.manager
    prompt = _tokens(20, 70)
    toks = prompt + _tokens(3 * BT, 71)
    assert m.reserve("a", 4 * BT + 1)
    m.keep_boundaries([_row("a", prompt, 2 * BT)])
    m.cache_blocks("a", 2 * BT, _view(toks))
    m.keep_boundaries([_row("a", prompt, 3 * BT, n=BT, sampled=False)])
    m.cache_blocks("a", 3 * BT, _view(toks))
    assert m.decode_snapshot["a"] == m.prefix.chain(toks, 2)
    assert {m.prefix.chain(toks, 2), m.prefix.chain(toks, 3)} <= set(m.prefix.snapshots)
