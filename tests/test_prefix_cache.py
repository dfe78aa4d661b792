"""Prefix caching (engine/cache/prefix.py, docs/prefix-cache.md) in whole engines (tiny V4 and V4.1 on CPU; the
block cache and the manager's seats on their own: tests/test_prefix_blocks.py): outputs with a hit equal outputs
without the cache (greedy in the default mode, bitwise logprobs in batch-invariant mode) wherever the prompts
part, after eviction and preemption, for concurrent sharers and with speculative decoding; the state after a
replay equals a full prefill's and a replay one position shorter does not; stats and the write floor."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.kernels.kv_formats import raw

ARCHS = ["deepseek_v4", "deepseek_v41"]
BT = 16                                  # blocks of 16 positions (the tiny models' compress ratios divide 16)
HIT = 112                                # 7 blocks: longer than either tiny model's replay (V4 61, V4.1 71)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(5, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(arch: str, cache: bool, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                block_size=BT, enable_prefix_caching=cache)
    return LLM(embedded_tiny_dir(arch), **{**args, **kw})


def _run(llm: LLM, prompts: list[list[int]], n: int = 8) -> list:
    sp = SamplingParams(max_tokens=n, temperature=0, logprobs=1)
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def _logprobs(out) -> list[float]:
    return [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)]


# ---------------------------------------------------------------------------------------------- engines

def _no_snapshots(llm: LLM) -> LLM:
    """Keep no ring snapshots (and drop those kept): every hit replays R (the path the replay rule's tests check)."""
    prefix = llm.engine.manager.prefix
    prefix.free_seats.extend(prefix.snapshots.values())
    prefix.snapshots.clear()
    llm.engine.manager.keep_boundaries = lambda rows, align: None
    return llm


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["reference", "invariant"])
@pytest.mark.parametrize("snapshots", [False, True])
def test_outputs_with_a_hit_equal_outputs_without(arch, backend, snapshots):
    """Prompts that part from a cached one at several offsets inside a block (and inside compression windows):
    greedy tokens equal the cache-free engine's; batch-invariant logprobs are bitwise equal. Without snapshots
    every hit replays R; with them (the cached prompt's pieces and decode rows left snapshots at 64, 128, 144)
    the hits start from a snapshot and replay less."""
    base = _tokens(160, 0)
    parted = [base[:cut] + _tokens(20, 10 + cut) for cut in (97, 99, 105, 111, 112, 118)]
    got, want = _llm(arch, True, kernel_backend=backend), _llm(arch, False, kernel_backend=backend)
    if not snapshots:
        _no_snapshots(got)
    _run(got, [base[:140]])
    got.engine.reset_stats()
    hits = []
    for prompt in parted:
        a, b = _run(got, [prompt])[0], _run(want, [prompt])[0]
        assert a.token_ids == b.token_ids
        if backend == "invariant":
            assert _logprobs(a) == _logprobs(b)
        hits.append(got.engine.stats.prefix_hit_tokens)
    stats = got.engine.stats
    assert stats.prefix_caching and stats.prefix_queried_tokens == sum(len(p) for p in parted)
    assert hits == [96, 192, 288, 384, 496, 608]             # cumulative: 6 blocks for the first four, then 7
    if snapshots:
        assert stats.prefix_snapshot_hits == 6 and stats.prefix_replayed_tokens < 6 * stats.prefix_replay_tokens
    else:
        assert stats.prefix_snapshot_hits == 0 and stats.prefix_replayed_tokens >= 6 * stats.prefix_replay_tokens
    assert 0 < stats.prefix_hit_rate < 1


def _ring_state(llm: LLM, slot: int, end: int) -> dict[str, torch.Tensor]:
    """Every ring's rows of positions end - span .. end - 1 (its declared span) in `slot`."""
    pools = llm.engine.manager.pools
    out = {}
    for name, ring in pools.rings.items():
        t, span = raw(ring), pools.spans[name]
        rows = torch.tensor([p % t.shape[1] for p in range(end - span, end)])
        out[name] = t[slot, rows].clone()
    return out


def _state_at(llm: LLM, prompt: list[int], at: int) -> dict[str, torch.Tensor]:
    """The rings of the prompt's sequence once its positions 0 .. at-1 are computed (a step's piece ends there),
    seen before the next step launches."""
    seen, last = {}, {}

    def observe(rows):
        row = last.get("row")
        if row is not None and row.start + row.n == at and "state" not in seen:
            seen["state"] = _ring_state(llm, row.slot, at)
        last["row"] = rows[0] if rows else None
    llm.engine.step_observers.append(observe)
    try:
        _run(llm, [prompt], n=2)
    finally:
        llm.engine.step_observers.remove(observe)
    return seen["state"]


def _full_prefill_state(arch: str, prompt: list[int]) -> dict[str, torch.Tensor]:
    return _state_at(_llm(arch, False, max_num_batched_tokens=BT), prompt, HIT)      # pieces of 16 end at 112


def _replayed_state(llm: LLM, replay: int, base: list[int]) -> dict[str, torch.Tensor]:
    """The rings at 112 after a hit of 112 whose replay is `replay` positions, in one piece (the engine has the
    prefix cached; each call's prompt has a tail of its own, so its blocks never lengthen the next call's hit)."""
    _no_snapshots(llm)
    llm.engine.manager.prefix.replay_tokens = replay
    llm.engine.scheduler.max_tokens = replay
    before = llm.engine.stats.prefix_hit_tokens
    got = _state_at(llm, base[:HIT] + _tokens(20, 1000 + before), HIT)
    assert llm.engine.stats.prefix_hit_tokens - before == HIT
    return got


@pytest.mark.parametrize("arch,rings", [("deepseek_v4", ("0.window", "1.window", "1.kv.pending_kv")),
                                        ("deepseek_v41", ("engram", "0.window", "1.window"))])
def test_a_ring_needs_its_rows_plus_depth_of_replay(arch, rings):
    """After a hit of 112 positions, a replay of a ring's rows + depth positions leaves it as a full prefill does
    (to float noise: the pieces differ); one position less leaves a row of it wrong by far more. Each window below
    a ring adds W - 1 to its depth (spec.Ring.depth), and the replay is the largest rows + depth (next test)."""
    base = _tokens(160, 1)
    prompt = base[:HIT] + _tokens(20, 2)
    want = _full_prefill_state(arch, prompt)
    llm = _llm(arch, True)
    _run(llm, [base[:140]])
    layout = llm.engine.manager.layout
    need = {r.name: layout.ring_rows(r) + r.depth for r in layout.spec.rings}
    for name in rings:
        diffs = [(_replayed_state(llm, need[name] - s, base)[name].double() - want[name].double()
                  ).abs().max().item() for s in (0, 1)]
        assert diffs[0] < 1e-4 < 1e-2 < diffs[1], (name, need[name], diffs)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_replay_rebuilds_every_ring(arch):
    """With the engine's replay R (the largest rows + depth) every ring equals a full prefill's at the hit, bitwise
    with batch-invariant kernels (with the reference ones a piece of R rows and pieces of 16 differ by float noise,
    which the model's rounded window rows turn into a whole rounding step). That rounding also absorbs the one
    stale position of R - 1 here, so the rule itself is the per-ring test's above."""
    base = _tokens(160, 1)
    prompt = base[:HIT] + _tokens(20, 2)
    want = _state_at(_llm(arch, False, max_num_batched_tokens=BT, kernel_backend="invariant"), prompt, HIT)
    llm = _llm(arch, True, kernel_backend="invariant")
    _run(llm, [base[:140]])
    got = _replayed_state(llm, llm.engine.manager.prefix.replay_tokens, base)
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_snapshot_serves_the_next_hit_without_replay(arch):
    """Agent traffic (one head, new tails): the first hit replays from the cold prompt's snapshot at 64 and ends its
    first piece at the hit (112), where its rings are kept; the next hit starts there and replays nothing. Greedy
    outputs equal the cache-free engine's."""
    head = _tokens(HIT, 20)
    prompts = [head + _tokens(20, 21 + i) for i in range(3)]
    got, want = _llm(arch, True), _llm(arch, False)
    seen = []
    for prompt in prompts:
        assert _run(got, [prompt])[0].token_ids == _run(want, [prompt])[0].token_ids
        s = got.engine.stats
        seen.append((s.prefix_hit_tokens, s.prefix_snapshot_hits, s.prefix_replayed_tokens))
    assert seen == [(0, 0, 0), (HIT, 1, HIT - 64), (2 * HIT, 2, HIT - 64)]


@pytest.mark.parametrize("arch", ARCHS)
def test_rings_from_a_snapshot_equal_a_full_prefill(arch):
    """Batch-invariant kernels: a sequence started from the snapshot at 112 has, after its next piece (at 128),
    every ring bitwise a full prefill's."""
    base = _tokens(160, 1)
    prompt = base[:HIT] + _tokens(20, 2)
    want = _state_at(_llm(arch, False, kernel_backend="invariant"), prompt, HIT + BT)
    llm = _llm(arch, True, kernel_backend="invariant")
    _run(llm, [base[:140]])                               # pieces of 16: snapshots at every block boundary
    got = _state_at(llm, prompt, HIT + BT)
    s = llm.engine.stats
    assert s.prefix_snapshot_hits == 1 and s.prefix_hit_tokens == HIT and s.prefix_replayed_tokens == 0
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_replay_keeps_no_snapshot_before_its_hit(arch):
    """Batch-invariant pieces of 16: a replay's pieces end at block boundaries below the hit, where its rings are
    not yet exact; rings are copied (and a seat taken, perhaps from a good snapshot) only from the hit on."""
    base = _tokens(160, 1)
    llm = _llm(arch, True, kernel_backend="invariant")
    m = _no_snapshots(llm).engine.manager
    _run(llm, [base[:140]])                               # cached blocks, no snapshots: the next hit replays
    del m.keep_boundaries                                 # the manager's own again
    copies, keep = [], m.pools.keep_rings
    m.pools.keep_rings = lambda slot, seat: (copies.append(seat), keep(slot, seat))
    prompt = base[:HIT] + _tokens(20, 2)
    _run(llm, [prompt])
    assert len(copies) == 2                               # at 112 and 128: none while replaying 48 .. 112
    assert llm.engine.stats.prefix_replayed_tokens >= m.prefix.replay_tokens
    kept = [k * BT for k in range(1, len(prompt) // BT + 1) if m.prefix.chain(prompt, k) in m.prefix.snapshots]
    assert kept == [HIT, HIT + BT]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_conversation_resumes_from_its_decode_snapshot(arch):
    """Multi-turn chat: the decode row that ended at 128 left a snapshot; the next turn (the conversation so far
    and a new message) starts there and replays nothing. Greedy outputs equal the cache-free engine's."""
    first = _tokens(100, 30)
    got, want = _llm(arch, True), _llm(arch, False)
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)     # computed: 100 + 29 positions
    a = got.generate([first], sp, use_tqdm=False)[0].outputs[0]
    assert a.token_ids == want.generate([first], sp, use_tqdm=False)[0].outputs[0].token_ids
    second = first + list(a.token_ids) + _tokens(10, 31)
    assert _run(got, [second])[0].token_ids == _run(want, [second])[0].token_ids
    s = got.engine.stats
    assert s.prefix_hit_tokens == 128 and s.prefix_snapshot_hits == 1 and s.prefix_replayed_tokens == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_long_generation_keeps_one_decode_snapshot(arch):
    """Two seats, eight snapshot seats: a cached prompt leaves snapshots at 64 and 128; a 220-token generation
    crosses 13 block boundaries but holds one snapshot seat (its newest), so the prompt's survive and a request
    parting from it at 140 starts from the one at 128 and replays nothing; the generation's last snapshot stays
    served after it finishes. Greedy outputs equal the cache-free engine's."""
    base = _tokens(140, 50)
    got, want = _llm(arch, True, max_num_seqs=2), _llm(arch, False, max_num_seqs=2)
    m = got.engine.manager
    assert m.pools.snapshot_seats == 8
    _run(got, [base])
    kept = set(m.prefix.snapshots)
    assert {m.prefix.chain(base, 4), m.prefix.chain(base, 8)} <= kept
    long = _tokens(20, 51)
    assert _run(got, [long], n=220)[0].token_ids == (out := _run(want, [long], n=220)[0].token_ids)
    held, last = set(m.prefix.snapshots) - kept, (len(long) + len(out) - 1) // BT     # the last boundary computed
    assert len(out) > 6 * BT and kept <= set(m.prefix.snapshots) and held == {m.prefix.chain(long + list(out), last)}
    before = got.engine.stats.prefix_replayed_tokens
    prompt = base + _tokens(10, 52)
    assert _run(got, [prompt])[0].token_ids == _run(want, [prompt])[0].token_ids
    s = got.engine.stats
    assert s.prefix_snapshot_hits == 1 and s.prefix_replayed_tokens == before and s.prefix_hit_tokens == 128


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("interval,replayed", [(0, HIT - 64), (32, HIT - 96)])
def test_interior_snapshots_shorten_a_first_hit(arch, interval, replayed):
    """Pieces of 64: the cold prompt's pieces end at 64 and 128 (snapshots there); with an interval of 32 the
    forward also writes its rings as at 32 and 96 into snapshot seats (V4.1's marked pieces run untruncated: their
    upper layers' rings need those rows). The one at 96 equals the rings of a prefill whose piece ends at 96 (to
    float noise), and the first hit of 112 replays from it, not from 64. Greedy outputs equal the cache-free
    engine's; logprobs to a rounding step of V4.1's rounded window rows, which float noise between different
    pieces can flip (docs/prefix-cache.md)."""
    base = _tokens(160, 1)
    got = _llm(arch, True, prefix_snapshot_interval=interval)
    want = _llm(arch, False)
    _run(got, [base[:140]])
    m = got.engine.manager
    kept = [k * BT for k in range(1, 140 // BT + 1) if m.prefix.chain(base, k) in m.prefix.snapshots]
    assert kept == ([32, 64, 96, 128] if interval else [64, 128])
    if interval:
        seat, pools = m.prefix.snapshots[m.prefix.chain(base, 6)], m.pools
        ref = _state_at(_llm(arch, False, max_num_batched_tokens=BT), base[:140], 96)
        for name, ring in pools.rings.items():
            t = raw(pools.snapshot_store(ring))
            rows = torch.tensor([p % t.shape[1] for p in range(96 - pools.spans[name], 96)])
            assert (t[seat, rows].double() - ref[name].double()).abs().max() < 1e-5, name
    got.engine.reset_stats()
    prompt = base[:HIT] + _tokens(20, 2)
    a, b = _run(got, [prompt])[0], _run(want, [prompt])[0]
    assert a.token_ids == b.token_ids
    assert max(abs(x - y) for x, y in zip(_logprobs(a), _logprobs(b))) < 0.05
    s = got.engine.stats
    assert (s.prefix_hit_tokens, s.prefix_snapshot_hits, s.prefix_replayed_tokens) == (HIT, 1, replayed)


def test_interior_snapshots_beside_a_truncated_piece():
    """V4.1, one step: a marked piece (untruncated) beside a short prompt whose piece runs YOCO-truncated: the model
    runs its upper layers on the truncated sub-batch, which must keep writing the marks (its upper window rings at
    96 were stale, max 3.25, when it did not)."""
    base = _tokens(160, 1)
    got = _llm("deepseek_v41", True, prefix_snapshot_interval=32, max_num_batched_tokens=256)
    _run(got, [base[:140], _tokens(30, 5)])
    m, pools = got.engine.manager, got.engine.manager.pools
    seat = m.prefix.snapshots[m.prefix.chain(base, 6)]
    ref = _state_at(_llm("deepseek_v41", False, max_num_batched_tokens=BT), base[:140], 96)
    for name, ring in pools.rings.items():
        t = raw(pools.snapshot_store(ring))
        rows = torch.tensor([p % t.shape[1] for p in range(96 - pools.spans[name], 96)])
        assert (t[seat, rows].double() - ref[name].double()).abs().max() < 1e-5, name


def test_a_ring_mark_writes_the_rings_as_after_its_position():
    """ForwardBatch.write_ring with marks: seat k holds, at row p % span', the value of position p for the span'
    positions before its mark, from the marked segment's rows; a mark without those rows is refused."""
    from deepinfer.cache.forward_batch import ForwardBatch
    pools = _llm("deepseek_v4", True, prefix_snapshot_interval=32).engine.manager.pools
    starts, lens = [0, 40], [64, 30]
    fb = ForwardBatch.ragged(pools, [1, 2], starts, lens, 1, ring_marks=[(0, 32, 0), (1, 64, 3)])
    for name, ring in pools.rings.items():
        new = torch.randn(sum(lens), ring.shape[-1], generator=torch.Generator().manual_seed(len(name)))
        fb.write_ring(ring, new)
        seats, span = pools.snapshot_store(ring), ring.shape[1]
        for seat, first, start, at in ((0, 0, 0, 32), (3, lens[0], starts[1], 64)):   # first: the segment's row 0
            for p in range(at - span, at):
                assert torch.equal(seats[seat, p % span], new[first + p - start].to(ring.dtype)), (name, p)
    bad = ForwardBatch.ragged(pools, [1], [40], [30], 1, ring_marks=[(0, 48, 0)])
    with pytest.raises(RuntimeError, match="ring mark at 48"):
        bad.write_ring(next(iter(pools.rings.values())), torch.zeros(30, next(iter(pools.rings.values())).shape[-1]))


def test_interior_snapshot_seats_and_bad_intervals():
    """Four snapshot seats per sequence seat (piece ends, decode rows and interior snapshots share them); the
    interval rounds up to whole blocks, 0 by default where pieces run YOCO-truncated; a bad interval is one line."""
    from deepinfer.errors import DeepInferError
    seats = [(m.pools.snapshot_seats, m.num_slots, m.snapshot_interval) for m in (
        _llm("deepseek_v4", True, **kw).engine.manager for kw in ({}, {"prefix_snapshot_interval": 0},
                                                                  {"prefix_snapshot_interval": 20}))]
    assert seats == [(16, 4, 1024), (16, 4, 0), (16, 4, 32)]          # 20 rounds up to whole blocks of 16
    assert _llm("deepseek_v41", True).engine.manager.snapshot_interval == 0     # YOCO-truncated pieces
    for bad in (-1, 1.5, True):
        with pytest.raises(DeepInferError, match="prefix_snapshot_interval"):
            _llm("deepseek_v4", True, prefix_snapshot_interval=bad)
    with pytest.raises(DeepInferError, match="prefix cache, which is off"):
        _llm("deepseek_v4", False, prefix_snapshot_interval=32)
    with pytest.raises(DeepInferError, match="with speculative decoding"):
        _llm("deepseek_v4", True, prefix_snapshot_interval=32, speculative=True)
    assert _llm("deepseek_v4", True, speculative=True).engine.manager.snapshot_interval == 0


def test_snapshots_are_bounded_and_go_with_their_blocks():
    per_seq = 256 // BT
    llm = _llm("deepseek_v4", True, max_num_seqs=2, state_memory_bytes=_budget("deepseek_v4", 2, per_seq, 8))
    m = llm.engine.manager
    seats = m.pools.snapshot_seats
    assert seats == 4 * m.num_slots and m.num_slots == 2 and m.pools.num_blocks == 2 * per_seq
    for i in range(6):                                    # unrelated prompts: blocks evicted, snapshots with them
        _run(llm, [_tokens(120, 40 + i)])
        assert len(m.prefix.snapshots) + len(m.prefix.free_seats) == seats and not m.kept
        assert all(d in m.prefix.by_digest for d in m.prefix.snapshots)
    assert llm.engine.stats.prefix_evicted_blocks > 0
    m.forget_prefixes()
    assert not m.prefix.snapshots and sorted(m.prefix.free_seats) == list(range(seats))


@pytest.mark.parametrize("arch", ARCHS)
def test_hits_survive_eviction_preemption_and_concurrent_sharers(arch, monkeypatch):
    """A state budget of a few sequences: cached blocks are evicted for new ones, requests are preempted and come
    back (hitting what they computed); several requests share one cached prefix in the same steps; ring snapshots
    serve hits throughout (the sizing rule gives a budget this tight none, so the test lets snapshots take every
    byte past one max_model_len sequence: SNAPSHOT_SHARE = 1). Batch-invariant outputs equal the cache-free
    engine's throughout (the schedules differ: a hit starts later)."""
    monkeypatch.setattr("deepinfer.cache.manager.SNAPSHOT_SHARE", 1)
    shared = _tokens(HIT, 3)
    waves = [[shared + _tokens(20, 100 + 10 * w + i) for i in range(3)] for w in range(2)]
    waves.append([_tokens(130, 200 + i) for i in range(3)])                 # unrelated: evicts
    budget = dict(state_memory_bytes=_budget(arch, 3, 4, 12), kernel_backend="invariant", max_num_seqs=3)
    got, want = _llm(arch, True, **budget), _llm(arch, False, **budget)
    pools = got.engine.manager.pools
    assert (pools.num_slots, pools.num_blocks, pools.snapshot_seats) == (3, 256 // BT + 4, 12)   # 3 x 10 blocks asked
    for wave in waves:
        assert [o.token_ids for o in _run(got, wave, n=24)] == [o.token_ids for o in _run(want, wave, n=24)]
    s = got.engine.stats
    assert s.prefix_hit_tokens > 0 and s.prefix_evicted_blocks > 0 and s.preemptions > 0, s
    assert s.prefix_snapshot_hits > 0, s                  # 6 of them, nothing replayed, on both models (measured)


def _budget(arch: str, seats: int, extra_blocks: int, snapshots: int = 0, **kw) -> int:
    """State bytes that StateManager cuts into `seats` seats, the blocks of one max_model_len sequence plus
    `extra_blocks`, and the bytes of `snapshots` ring snapshots (its sizing: a scratch slot and block, one whole
    sequence, then seats, then blocks and snapshot seats): pass max_num_seqs=seats with it, or the bytes past the
    seats may buy more seats."""
    m = _llm(arch, False, **kw).engine.manager
    lay, blocks = m.layout, m.layout.blocks_for(m.max_model_len)
    slot = lay.bytes_per_slot() + 4 * blocks
    scratch = lay.bytes_per_slot() + lay.bytes_per_block() + 4 * blocks
    return scratch + seats * slot + (blocks + extra_blocks) * lay.bytes_per_block() + snapshots * lay.bytes_per_slot()


@pytest.mark.parametrize("arch", ARCHS)
def test_snapshot_seats_come_from_what_the_blocks_leave(arch):
    """Ring snapshot seats never cost a seat or the blocks of one max_model_len sequence: a tight budget gets the
    same seats and blocks as without prefix caching and no snapshot seats; bytes the blocks cannot use (past every
    seat's max_model_len) become seats up to four per seat; otherwise they take at most a sixteenth of the blocks'
    bytes; the smallest budget that holds one sequence still does."""
    per_seq, lay = 256 // BT, _llm(arch, False).engine.manager.layout
    ring, block = lay.bytes_per_slot(), lay.bytes_per_block()

    def sized(budget, **kw):
        on, off = (_llm(arch, c, state_memory_bytes=budget, **kw).engine.manager for c in (True, False))
        assert on.summary.endswith(f"{on.pools.snapshot_seats} ring snapshot seats, "
                                   f"{on.pools.nbytes() / 2**30:.3f} GiB")
        assert on.num_slots == off.num_slots                       # snapshot seats never cost a sequence seat
        assert on.pools.num_blocks == off.pools.num_blocks if not on.pools.snapshot_seats \
            else min(off.pools.num_blocks, per_seq) <= on.pools.num_blocks < off.pools.num_blocks \
            or on.pools.num_blocks == off.pools.num_blocks == on.num_slots * per_seq
        return on.num_slots, on.pools.num_blocks, on.pools.snapshot_seats

    assert sized(_budget(arch, 3, 4), max_num_seqs=3) == (3, per_seq + 4, 0)
    assert sized(_budget(arch, 1, 0)) == (1, per_seq, 0)
    assert sized(_budget(arch, 4, 3 * per_seq, 5)) == (4, 4 * per_seq, 5)          # the blocks are capped: spare bytes
    assert sized(_budget(arch, 4, 3 * per_seq, 40)) == (4, 4 * per_seq, 16)         # four per seat at most
    long, per_long = dict(max_model_len=1024, max_num_seqs=8), 1024 // BT   # blocks short of their cap (8 x 64)
    rest = 6 * per_long * block                                    # what the seats leave: six sequences' blocks
    slots, blocks, seats = sized(_budget(arch, 8, 5 * per_long, **long), **long)
    assert (slots, seats) == (8, rest // 16 // ring) and seats > 0          # a sixteenth of the blocks' bytes
    assert blocks == (rest - seats * ring) // block


@pytest.mark.parametrize("arch", ARCHS)
def test_hits_with_speculative_decoding(arch):
    """The drafter's rings are replayed too (their depth counts): speculative outputs with a hit equal the
    cache-free engine's (greedy)."""
    spec = {"schedule": "fixed", "num_speculative_tokens": 2}
    base = _tokens(160, 4)
    got, want = (_llm(arch, c, speculative=spec, kernel_backend="invariant") for c in (True, False))
    rings = got.model.drafting.rings
    m = got.engine.manager
    assert m.prefix.replay_tokens == max(m.layout.ring_rows(r) + r.depth for r in m.layout.spec.rings)
    assert any(r.name in rings for r in m.layout.spec.rings
               if m.layout.ring_rows(r) + r.depth == m.prefix.replay_tokens)
    for prompt in (base[:140], base[:HIT] + _tokens(20, 5)):
        assert _run(got, [prompt], n=16)[0].token_ids == _run(want, [prompt], n=16)[0].token_ids
    assert got.engine.stats.prefix_hit_tokens == HIT


def test_a_changed_model_forgets_its_prefixes_and_stats_reset():
    llm = _llm("deepseek_v4", True)
    prompt = _tokens(130, 6)
    _run(llm, [prompt]), _run(llm, [prompt])
    assert llm.engine.stats.prefix_hit_tokens == 128 and llm.engine.stats.prefix_cached_blocks > 0
    llm.engine.modules_changed()
    assert llm.engine.stats.prefix_cached_blocks == 0
    llm.engine.reset_stats()
    _run(llm, [prompt])
    s = llm.engine.stats
    assert s.prefix_hit_tokens == 0 and s.prefix_queried_tokens == 130 and s.prefix_hit_rate == 0


def test_prompt_logprobs_never_take_a_hit():
    llm = _llm("deepseek_v4", True)
    prompt = _tokens(130, 7)
    _run(llm, [prompt])
    llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert llm.engine.stats.prefix_hit_tokens == 0


def test_on_by_default_and_bad_values_are_one_line():
    from deepinfer.errors import DeepInferError
    default = LLM(embedded_tiny_dir("deepseek_v4"), device="cpu", max_model_len=256)
    assert default.engine.stats.prefix_caching and default.engine.manager.pools.snapshot_seats > 0
    llm = _llm("deepseek_v4", False)
    assert not llm.engine.stats.prefix_caching and llm.engine.stats.prefix_hit_rate is None
    with pytest.raises(DeepInferError, match="enable_prefix_caching"):
        _llm("deepseek_v4", "yes")


def test_compact_truncation_is_exact_from_the_exact_rows_on_and_close_below(monkeypatch):
    """DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE=compact keeps KEEP rows from the last KV source on: with KEEP at
    least the exact suffix (29 rows on tiny V4.1: 4 layers x (W - 1) + 1) it is the exact mode; at KEEP = W it is
    approximate, its first-token error under 0.15 of a logprob (docs/prefix-cache.md: 0.006 and 0.07 measured on
    two prompt sets)."""
    prompts = [_tokens(n, s) for s, n in ((0, 120), (1, 200), (2, 333))]

    def first(mode: str, keep: int = 140) -> list[float]:
        monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", mode)
        monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", str(keep))
        llm = _llm("deepseek_v41", False, max_num_batched_tokens=512, max_model_len=512)
        assert llm.engine.runner.truncate_keep == (keep if mode == "compact" else None)
        return [o.logprobs[0][o.token_ids[0]].logprob for o in _run(llm, prompts, n=1)]
    exact = first("exact")
    assert max(abs(a - b) for a, b in zip(first("compact", 29), exact)) < 1e-5
    err = max(abs(a - b) for a, b in zip(first("compact", 8), exact))
    assert 1e-4 < err < 0.15, err
