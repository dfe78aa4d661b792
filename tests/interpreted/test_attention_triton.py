"""kernels/attention_triton.py in Triton's interpreter against the reference `sparse_sink_attention` on fresh
random inputs: one and two sources (window + entries), -1 holes anywhere, rows with no key at all (output 0: the
sink only), a source boundary inside a key tile, K not a multiple of the tile, one pass and split-KV (forced and
chosen), heads and dims that are not powers of two (the tiny presets: 4 heads x 96), fp32 and fp16.
The interpreter has no bf16; the GPU test (tests/test_kernels_attention_triton.py) runs bf16 at released shapes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import attention as ka
from deepinfer.kernels import attention_triton as kat

BOUND = {torch.float32: 2e-6, torch.float16: 2e-3}     # max |kernel - reference| / max |reference|


def inputs(n, h, d, k1, k2, dtype, seed=0, holes=0.2, empty_rows=(), stores=(40, 70)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, d, generator=g)
    sink = torch.randn(h, generator=g)
    sources = []
    for m, k in zip(stores, (k1, k2)):
        if k is None:
            continue
        store = torch.randn(m, d, generator=g)
        index = torch.randint(0, m, (n, k), generator=g)
        index[torch.rand(n, k, generator=g) < holes] = -1
        for r in empty_rows:
            index[r] = -1
        sources.append((store.to(dtype), index))
    return q.to(dtype), sources, sink


def check(q, sources, sink, scale, **kw):
    f32 = lambda s: ka.SplitStore(s.ring.float(), s.new.float()) if isinstance(s, ka.SplitStore) else s.float()  # noqa
    want = ka._sparse_sink_attention(q.float(), [(f32(s), i) for s, i in sources], sink, scale)
    got = kat.sparse_attention(q, sources, sink, scale, **kw)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))
    assert err <= BOUND[q.dtype], err
    return got, want


def test_runs_interpreted():
    assert kat.INTERPRETED and kat.supported(*inputs(2, 4, 16, 8, 8, torch.float32)[:2])


@pytest.mark.parametrize("n,h,d,k1,k2", [(3, 4, 96, 16, 9), (5, 16, 64, 128, 40), (2, 64, 128, 33, None),
                                         (1, 8, 32, 0, 70), (4, 1, 16, 5, 5)])
@pytest.mark.parametrize("splits", [None, 0, 3])
@pytest.mark.parametrize("block_h", [64, 4])
def test_matches_reference(n, h, d, k1, k2, splits, block_h):
    """block_h 4: the heads in blocks of 4, one program each (a partial last block where h is not a multiple)."""
    q, sources, sink = inputs(n, h, d, k1, k2, torch.float32, seed=n * 7 + h, empty_rows=(0,) if n > 2 else ())
    tiles = kat.AttnTiles(block_n=16, split=32, warps=4, stages=1, block_h=block_h)
    got, want = check(q, sources, sink, d ** -0.5, tiles=tiles, splits=splits)
    if n > 2:
        assert torch.equal(got[0], torch.zeros_like(got[0]))               # no key: the sink alone, output 0


@pytest.mark.parametrize("splits", [0, 3])
def test_split_store_window(splits):
    """The window as the model passes it: a SplitStore of the ring pool and this step's rows, read in place."""
    g = torch.Generator().manual_seed(11)
    n, h, d = 6, 4, 96
    ring, new = torch.randn(5 * 16, d, generator=g), torch.randn(n, d, generator=g)
    index = torch.randint(-1, ring.shape[0] + n, (n, 16), generator=g)     # ring rows, new rows, holes
    entries = torch.randn(30, d, generator=g)
    sources = [(ka.SplitStore(ring, new), index), (entries, torch.randint(-1, 30, (n, 9), generator=g))]
    q, sink = torch.randn(n, h, d, generator=g), torch.randn(h, generator=g)
    got, want = check(q, sources, sink, 0.1, tiles=kat.AttnTiles(16, 32, 4, 1), splits=splits)
    flat = torch.cat([ring, new])                                       # the copy the model no longer makes
    assert torch.equal(want, ka._sparse_sink_attention(q, [(flat, index), sources[1]], sink, 0.1))


def test_fp16_and_the_default_tiles():
    q, sources, sink = inputs(6, 16, 64, 128, 64, torch.float16, seed=3)
    check(q, sources, sink, 0.125)                                          # DECODE tiles, splits chosen
    check(q, sources, sink, 0.125, invariant=True)


def test_a_row_alone_equals_the_row_in_a_batch():
    """Every mode reads only the row's own keys: bits do not depend on the batch (the invariant set's premise)."""
    q, sources, sink = inputs(9, 8, 64, 24, 50, torch.float32, seed=5)
    tiles = kat.AttnTiles(block_n=16, split=32, warps=4, stages=1)
    for splits in (0, 3):
        full = kat.sparse_attention(q, sources, sink, 0.1, tiles=tiles, splits=splits)
        alone = kat.sparse_attention(q[4:5], [(s, i[4:5]) for s, i in sources], sink, 0.1, tiles=tiles,
                                     splits=splits)
        assert torch.equal(full[4:5], alone)


def test_split_plan():
    t, cpu = kat.DECODE, torch.device("cpu")                # 16 SMs under the interpreter
    assert kat.split_plan(1, 64, 640, t, cpu, invariant=False) == (10, 64)    # 2 head blocks: ~2 programs a SM
    assert kat.split_plan(4, 64, 640, t, cpu, invariant=False) == (5, 128)    # capped at tiles.split
    assert kat.split_plan(64, 64, 640, t, cpu, invariant=False) == (0, 640)   # the rows fill the SMs: one pass
    assert kat.split_plan(1, 64, 16, t, cpu, invariant=False) == (0, 16)      # one tile of keys: one pass
    assert kat.split_plan(4, 64, 640, kat.AttnTiles(16, 128, 8, 2, block_h=16), cpu, invariant=False) == (0, 640)
    assert kat.split_plan(64, 64, 640, t, cpu, invariant=True) == (5, 128)    # invariant: the fixed split
    assert kat.split_plan(1, 64, 0, t, cpu, invariant=True) == (1, 128)       # always split, even no key
    assert kat.split_plan(64, 64, 128, t, cpu, invariant=True) == (1, 128)


def test_a_permuted_q_gives_the_same_output():
    q, sources, sink = inputs(3, 4, 32, 8, 8, torch.float32, seed=13)
    permuted = q.permute(0, 2, 1).contiguous().permute(0, 2, 1)          # same values, heads innermost
    assert permuted.stride(-1) != 1
    assert torch.equal(kat.sparse_attention(permuted, sources, sink, 0.2), kat.sparse_attention(q, sources, sink, 0.2))


def test_through_the_op_fallbacks():
    """Unsupported inputs (three sources, float64) go to the torch backends unchanged."""
    q, sources, sink = inputs(3, 4, 32, 8, 8, torch.float64, seed=9)
    assert not kat.supported(q, sources)
    assert torch.equal(kat.sparse_sink_attention_triton(q, sources, sink, 0.2),
                       ka._sparse_sink_attention(q, sources, sink, 0.2))
    three = sources + sources[:1]
    q32 = q.float()
    three32 = [(s.float(), i) for s, i in three]
    assert not kat.supported(q32, three32)
    assert torch.equal(kat.sparse_sink_attention_triton_invariant(q32, three32, sink, 0.2),
                       ka._sparse_sink_attention_tiles(q32, three32, sink, 0.2))
