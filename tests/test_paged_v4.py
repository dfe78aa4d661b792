"""The paged decode step (engine/models/paged_v4.py) over the state pools equals the reference decode
(model.extend on SequenceStates), leaves the pools holding what the reference state holds, does not depend on the
batch it runs in, and has no data-dependent shapes or host syncs (meta tensors on CPU, a CUDA graph on GPU)."""

import copy
import dataclasses
import random

import pytest
import torch

from deepinfer.cache.pools import PoolLayout, StatePools
from deepinfer.config.deepseek_v4 import CSA, HCA
from deepinfer.config.presets import TINY_V4
from deepinfer.models import build_model
from deepinfer.models.moe import all_experts_routing
from deepinfer.models.paged_v4 import decode_step

from .helpers import our_model

TOL = 1e-9
# The release's HCA ratio (128) on the tiny preset: entry blocks of 128 positions.
TINY_HCA128 = dataclasses.replace(TINY_V4, compress_rates=((CSA, 4), (HCA, 128)))
# slot -> prefill length: CSA window 0 closes during decode (3 -> p=3), HCA windows close (p=127 and p=255),
# entry blocks are crossed (128, 256); every ring wraps.
PREFILL = {2: 3, 1: 250, 3: 100}
ORDER = [2, 0, 1, 3]                         # slot 0: a padding row


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is faster here and immune to oversubscription on a busy CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prefilled(model, decode_steps: int, seed: int = 0):
    """Pools (stale NaN state everywhere) holding the PREFILL sequences, shuffled blocks for prefill + decode;
    and each sequence's own reference state."""
    layout = PoolLayout.for_model(model)
    max_len = max(PREFILL.values()) + decode_steps + 200        # more block-table columns than any row needs
    need = {s: layout.blocks_for(n + decode_steps + 32) for s, n in PREFILL.items()}
    pools = StatePools(layout, num_slots=4, num_blocks=sum(need.values()) + 2, max_model_len=max_len,
                       device=model.device)
    for _, t in _live(pools):                 # stale state a decode must never read: NaN shows a leak
        t.fill_(float("nan"))
    free = list(range(1, pools.num_blocks + 1))
    random.Random(seed).shuffle(free)
    for slot, n in need.items():
        pools.block_table[slot, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed)
    states = {s: model.new_state() for s in PREFILL}
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=gen) for n in PREFILL.values()]
    model.extend(prompts, list(states.values()))
    for slot, st in states.items():
        pools.store_state(slot, st, 0)
    return pools, states


def _step(model, pools, order, pos, toks, ctx_blocks):
    """decode_step on the rows of slots `order` (slot 0: padding, token 0 at position 0) -> {slot: logits [V]}."""
    dev = model.device
    rows = lambda v: torch.tensor([v[s] if s else 0 for s in order], dtype=torch.long, device=dev)  # noqa: E731
    out = decode_step(model, pools, torch.tensor(order, device=dev), rows(pos), rows(toks), ctx_blocks)
    assert out.shape == (len(order), model.cfg.vocab_size) and out.dtype == torch.float32
    return {s: out[i] for i, s in enumerate(order) if s}


@pytest.mark.parametrize("cfg,qat,steps", [(TINY_HCA128, True, 150), (TINY_V4, False, 60)],
                         ids=["hca128-qat1", "tiny-qat0"])
def test_decode_matches_reference(cfg, qat, steps):
    model = our_model(cfg, seed=3, dtype=torch.float64, qat=qat)
    pools, states = _prefilled(model, steps)
    lay, ratios = pools.layout, {s.ratio for s in pools.layout.streams}
    pos = dict(PREFILL)
    gen = torch.Generator().manual_seed(7)
    seen, worst = set(), 0.0
    for _ in range(steps):
        toks = {s: int(t) for s, t in zip(PREFILL, torch.randint(0, cfg.vocab_size, (len(PREFILL),), generator=gen))}
        got = _step(model, pools, ORDER, pos, toks, pools.max_blocks)
        ref = model.extend([torch.tensor([toks[s]]) for s in PREFILL], list(states.values()))
        for s, r in zip(PREFILL, ref):
            worst = max(worst, (got[s] - r[0]).abs().max().item())
            p = pos[s]
            seen |= {("close", r_) for r_ in ratios if (p + 1) % r_ == 0}
            seen |= {e for e, hit in (("block", p % lay.block_tokens == 0), ("wrap", p >= lay.window),
                                      ("first window", p + 1 == min(ratios))) if hit}
            pos[s] += 1
    assert worst <= TOL, worst
    assert seen >= {("close", r) for r in ratios} | {"block", "wrap", "first window"}, seen
    # what the pools hold continues like the reference state
    cont = torch.randint(0, cfg.vocab_size, (len(PREFILL), 21), generator=gen)
    loaded = [pools.load_state(s, pos[s], model.new_state()) for s in PREFILL]
    for via_pool, direct, a, b in zip(model.extend(list(cont), loaded), model.extend(list(cont), list(states.values())),
                                      loaded, states.values()):
        assert (via_pool - direct).abs().max().item() <= TOL
        assert a.nbytes() == b.nbytes()


def test_batch_composition_does_not_matter():
    """Same sequences, same tokens: one batch, another order with more padding rows and more block columns,
    one row at a time; logits and pool state agree."""
    model = our_model(TINY_HCA128, seed=4, dtype=torch.float64, qat=True)
    pools, _ = _prefilled(model, 12)
    layouts = {"batch": ([[1, 2, 3]], 3), "padded": ([[0, 3, 0, 1, 2, 0]], pools.max_blocks),
               "one by one": ([[3], [1], [2]], 3)}
    runs = {name: copy.deepcopy(pools) for name in layouts}
    gen = torch.Generator().manual_seed(9)
    pos = dict(PREFILL)
    for _ in range(12):
        toks = {s: int(torch.randint(0, model.cfg.vocab_size, (1,), generator=gen)) for s in PREFILL}
        logits = {}
        for name, (batches, ctx) in layouts.items():
            logits[name] = {}
            for order in batches:
                logits[name].update(_step(model, runs[name], order, pos, toks, ctx))
        for s in PREFILL:
            for name in layouts:
                assert (logits[name][s] - logits["batch"][s]).abs().max().item() <= TOL, (name, s)
            pos[s] += 1
    for name, run in runs.items():
        for s in PREFILL:
            a = run.load_state(s, pos[s], model.new_state())
            b = runs["batch"].load_state(s, pos[s], model.new_state())
            for la, lb in zip(a.layers, b.layers):
                assert (la.window - lb.window).abs().max().item() <= 1e-12, name
                for ca, cb in ((la.compressor, lb.compressor), (la.indexer, lb.indexer)):
                    if ca is not None and ca.entries is not None:
                        assert (ca.entries - cb.entries).abs().max().item() <= 1e-12, name


def test_no_data_dependent_ops_meta():
    """On meta tensors every op that reads values (.item(), .tolist(), .nonzero(), masks, .unique()) raises:
    the step runs there, the reference routed MoE does not."""
    model = build_model(TINY_V4, "meta", torch.float64, qat_fake_quant=True)
    pools = StatePools(PoolLayout.for_model(model), 3, 8, 256, torch.device("meta"))
    for b, ctx in ((1, 1), (5, 4)):
        z = torch.zeros(b, dtype=torch.long, device="meta")
        assert decode_step(model, pools, z, z, z, ctx).shape == (b, TINY_V4.vocab_size)
    moe, x = model.layers[2].ffn, torch.zeros(3, TINY_V4.hidden_size, dtype=torch.float64, device="meta")
    with pytest.raises((NotImplementedError, RuntimeError)):
        moe(x)
    with all_experts_routing():
        assert moe(x).shape == x.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qat", [False, True], ids=["qat0", "qat1"])
def test_cuda_graph_capture(qat):
    """The step captures into a CUDA graph (no host sync, static shapes) and runs eagerly under sync-debug
    "error"; the first replay equals the eager step (logits and every pool tensor), and replays with new
    positions / tokens written into the captured inputs follow the reference decode."""
    steps = 12
    model = our_model(TINY_HCA128, seed=3, dtype=torch.float64, qat=qat, device="cuda")
    pools, states = _prefilled(model, steps)
    dev, real = model.device, [i for i, s in enumerate(ORDER) if s]
    slots, positions, tokens = (torch.zeros(len(ORDER), dtype=torch.long, device=dev) for _ in range(3))
    slots.copy_(torch.tensor(ORDER))
    args = (model, pools, slots, positions, tokens, pools.max_blocks)
    pos, gen = dict(PREFILL), torch.Generator().manual_seed(5)

    def set_inputs():
        toks = {s: int(torch.randint(0, model.cfg.vocab_size, (1,), generator=gen)) for s in PREFILL}
        positions.copy_(torch.tensor([pos.get(s, 0) for s in ORDER]))
        tokens.copy_(torch.tensor([toks.get(s, 0) for s in ORDER]))
        return toks

    toks = set_inputs()
    before = _snapshot(pools)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode_step(*args)                                   # warm-up
    torch.cuda.current_stream().wait_stream(side)
    _restore(pools, before)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = decode_step(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    after_eager = _snapshot(pools)
    _restore(pools, before)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(*args)
    for step in range(steps):
        if step:
            toks = set_inputs()
        graph.replay()
        if step == 0:
            assert (out[real] - eager[real]).abs().max().item() <= TOL
            for (name, a), (_, b) in zip(_snapshot(pools), after_eager):
                assert torch.allclose(a[1:], b[1:], rtol=0, atol=1e-12, equal_nan=True), name   # beyond scratch
        ref = model.extend([torch.tensor([toks[s]]) for s in PREFILL], list(states.values()))
        for s, r in zip(PREFILL, ref):
            assert (out[ORDER.index(s)] - r[0]).abs().max().item() <= TOL, (step, s)
            pos[s] += 1


def _live(pools):
    """Every float pool tensor, by name."""
    named = [(f"window{i}", t) for i, t in enumerate(pools.window)]
    for kind in ("pending_kv", "pending_score", "prev_a_kv", "prev_a_score", "entries"):
        named += [(f"{kind}[{k}]", t) for k, t in getattr(pools, kind).items()]
    return named


def _snapshot(pools):
    return [(n, t.clone()) for n, t in _live(pools)]


def _restore(pools, saved):
    for (_, t), (_, v) in zip(_live(pools), saved):
        t.copy_(v)
