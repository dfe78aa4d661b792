"""Packed KV records (kernels/kv_formats.py) read in place by the Triton attention and indexer kernels, in Triton's
interpreter, against the reference ops on the same PackedStores (which unpack the rows they gather): every format
(V4's FP8 latent with its bf16 RoPE tail, V4.1's FP8 window and FP4 / e4m3-scale entries, FP4 / ue8m0 index keys),
a packed ring beside this step's plain rows (SplitStore), a packed entry store as the second source, -1 holes and
empty rows, one pass and split-KV. fp32 compute (the interpreter has no bf16); the GPU test runs bf16."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import attention as ka
from deepinfer.kernels import attention_triton as kat
from deepinfer.kernels import indexer as ki
from deepinfer.kernels import indexer_triton as kit
from deepinfer.kernels.kv_formats import KVFormat, PackedStore

BOUND = 2e-6
FORMATS = {"v4_latent": KVFormat("fp8", 96, 64, tail=32), "v41_window": KVFormat("fp8", 96, 32),
           "v41_entry": KVFormat("fp4", 96, 16, scale="e4m3"), "index_key": KVFormat("fp4", 64, 32)}


def packed(fmt: KVFormat, rows: int, g: torch.Generator, lead=()) -> PackedStore:
    x = torch.randn(*lead, rows, fmt.width, generator=g) * torch.logspace(-3, 1, rows).unsqueeze(-1)
    return PackedStore(fmt.pack(x), fmt, torch.float32)


def rel(got, want) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("ring_fmt,entry_fmt", [("v4_latent", "v4_latent"), ("v41_window", "v41_entry")])
@pytest.mark.parametrize("splits", [0, 3])
def test_attention_reads_packed_window_and_entries(ring_fmt, entry_fmt, splits):
    g = torch.Generator().manual_seed(len(ring_fmt) + splits)
    n, h, d, window, k2 = 5, 4, 96, 12, 20
    ring = packed(FORMATS[ring_fmt], 6 * 8, g)                       # 6 slots x span 8, flattened
    new = torch.randn(n, d, generator=g)
    w_index = torch.randint(0, ring.shape[0] + n, (n, window), generator=g)
    w_index[torch.rand(n, window, generator=g) < 0.2] = -1
    entries = packed(FORMATS[entry_fmt], 50, g)
    e_index = torch.randint(0, 50, (n, k2), generator=g)
    e_index[torch.rand(n, k2, generator=g) < 0.3] = -1
    w_index[0], e_index[0] = -1, -1                                   # a row with no key: the sink only
    q, sink = torch.randn(n, h, d, generator=g), torch.randn(h, generator=g)
    sources = [(ka.SplitStore(ring, new), w_index), (entries, e_index)]
    assert kat.supported(q, sources)
    tiles = kat.AttnTiles(block_n=16, split=16, warps=4, stages=1, block_h=4)
    got = kat.sparse_attention(q, sources, sink, d ** -0.5, tiles=tiles, splits=splits)
    want = ka._sparse_sink_attention(q, sources, sink, d ** -0.5)
    assert rel(got, want) <= BOUND
    assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_attention_reads_a_packed_store_alone():
    g = torch.Generator().manual_seed(3)
    entries = packed(FORMATS["v41_entry"], 40, g)
    index = torch.randint(-1, 40, (3, 24), generator=g)
    q, sink = torch.randn(3, 4, 96, generator=g), torch.randn(4, generator=g)
    tiles = kat.AttnTiles(block_n=16, split=16, warps=4, stages=1, block_h=4)
    got = kat.sparse_attention(q, [(entries, index)], sink, 0.1, tiles=tiles, splits=0)
    assert rel(got, ka._sparse_sink_attention(q, [(entries, index)], sink, 0.1)) <= BOUND


def test_indexer_reads_packed_keys():
    g = torch.Generator().manual_seed(5)
    keys = packed(FORMATS["index_key"], 70, g)
    index = torch.randint(0, 70, (4, 90), generator=g)
    index[torch.rand(4, 90, generator=g) < 0.25] = -1
    q, w = torch.randn(4, 8, 64, generator=g), torch.randn(4, 8, generator=g)
    assert kit.supported(q, w, keys, index)
    got = kit.index_scores_kernel(q, w, keys, index, 0.125)
    want = ki._sparse_index_scores(q, w, keys, index, 0.125)
    fin = index >= 0
    assert torch.equal(got.isinf(), ~fin)
    assert float((got[fin] - want[fin]).abs().max() / want[fin].abs().max()) <= BOUND
