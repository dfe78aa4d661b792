"""kernels/attention_triton.py on a CUDA device (`-m gpu`): the sparse sink attention kernel in bf16 at released
widths (64 heads x 512) against the fp32 reference on fresh random inputs; window + selected entries, holes, rows
with no key, one pass and split-KV, batch invariance (a row alone = the row in a batch, bitwise, both modes) and
CUDA-graph capture. Bound: max |kernel - reference| / max |reference| <= GPU_BOUND (P is rounded to bf16 before
P.V, as FlashAttention does; the output is bf16). Passing this is what moves the kernel into the Triton backend
sets (kernels/registry.py OPS). CPU checks: tests/interpreted/test_attention_triton.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_BOUND = 1e-2


def _inputs(n, k1, k2, seed, holes=0.1, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(n, 64, 512, device=dev, generator=g).bfloat16()
    sink = torch.randn(64, device=dev, generator=g)
    win = torch.randn(n * 128 + 64, 512, device=dev, generator=g).bfloat16()
    ent = torch.randn(4096, 512, device=dev, generator=g).bfloat16()
    i1 = torch.randint(0, win.shape[0], (n, k1), device=dev, generator=g)
    i2 = torch.randint(0, ent.shape[0], (n, k2), device=dev, generator=g)
    for i in (i1, i2):
        i[torch.rand(i.shape, device=dev, generator=g) < holes] = -1
    if n > 1:
        i1[0] = -1
        i2[0] = -1                                                           # row 0: the sink alone
    return q, [(win, i1), (ent, i2)], sink


@pytest.mark.parametrize("n", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("k1,k2", [(128, 512), (128, 0), (128, 37)])
def test_matches_reference(n, k1, k2):
    from deepinfer.kernels import attention as ka
    from deepinfer.kernels import attention_triton as kat
    q, sources, sink = _inputs(n, k1, k2, seed=n + k2)
    if k2 == 0:
        sources = sources[:1]
    want = ka._sparse_sink_attention(q, sources, sink, 512 ** -0.5).float()
    variants = [(kat.DECODE, None), (kat.DECODE, 0), (kat.DECODE, 2), (kat.INVARIANT, None)]
    variants += [(kat.AttnTiles(16, split, 8, 2, block_h=bh), 2) for split in (16, 64) for bh in (16, 32)]
    for tiles, splits in variants:
        got = kat.sparse_attention(q, sources, sink, 512 ** -0.5, tiles=tiles, splits=splits)
        err = float((got.float() - want).abs().max() / want.abs().max())
        assert err <= GPU_BOUND, (tiles, splits, err)
        if n > 1:
            assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_split_store():
    """The window as the model passes it: a SplitStore (ring pool rows, then this step's rows) read in place."""
    from deepinfer.kernels import attention as ka
    from deepinfer.kernels import attention_triton as kat
    q, ((win, win_index), entries), sink = _inputs(32, 128, 512, seed=3)
    split = ka.SplitStore(win[:-40], win[-40:])
    want = ka._sparse_sink_attention(q, [(win, win_index), entries], sink, 0.05).float()
    got = kat.sparse_attention(q, [(split, win_index), entries], sink, 0.05).float()
    assert float((got - want).abs().max() / want.abs().max()) <= GPU_BOUND


def test_batch_invariance_and_graphs():
    from deepinfer.kernels import attention_triton as kat
    q, sources, sink = _inputs(96, 128, 512, seed=7)
    for invariant in (False, True):
        full = kat.sparse_attention(q, sources, sink, 0.05, invariant=invariant, splits=None if invariant else 0)
        for a, b in ((5, 6), (0, 40), (60, 96)):
            part = kat.sparse_attention(q[a:b], [(s, i[a:b]) for s, i in sources], sink, 0.05, invariant=invariant,
                                        splits=None if invariant else 0)
            assert torch.equal(part, full[a:b]), (invariant, a, b)
    for fn in (kat.sparse_sink_attention_triton, kat.sparse_sink_attention_triton_invariant):
        graph, out = capture_graph(fn, q, sources, sink, 0.05)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fn(q, sources, sink, 0.05))
