"""kernels/indexer_triton.py on a CUDA device (`-m gpu`): the lightning-indexer score kernel in bf16 at V4 (64 x
128) and V4.1 (32 x 128) index shapes against the fp32 reference on random inputs, -1 candidates, K tails, batch
invariance bitwise, CUDA-graph capture. Bound: per row, max |kernel - reference| / max |reference| <= GPU_BOUND
(bf16 inputs are exact in both; only the fp32 summation order differs). Passing this moves the kernel into the
Triton backend sets (kernels/registry.py OPS). CPU: tests/interpreted/test_indexer_triton.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_BOUND = 1e-4


@pytest.mark.parametrize("h", [64, 32])
@pytest.mark.parametrize("n,k", [(1, 4096), (16, 2048), (256, 1000), (2048, 513)])
def test_matches_reference(h, n, k):
    from deepinfer.kernels import indexer as ki
    from deepinfer.kernels import indexer_triton as kit
    g = torch.Generator(device="cuda").manual_seed(n + k + h)
    q = torch.randn(n, h, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, h, device="cuda", generator=g)
    store = torch.randn(8192, 128, device="cuda", generator=g).bfloat16()
    index = torch.randint(0, 8192, (n, k), device="cuda", generator=g)
    index[torch.rand(n, k, device="cuda", generator=g) < 0.1] = -1
    want = ki._sparse_index_scores(q, w, store, index, 128 ** -0.5)
    got = kit.sparse_index_scores_triton(q, w, store, index, 128 ** -0.5)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    err = (got - want).abs().where(finite, 0).amax(-1) / want.abs().where(finite, 0).amax(-1).clamp_min(1e-30)
    assert float(err.max()) <= GPU_BOUND
    if n > 1:
        assert torch.equal(kit.index_scores_kernel(q[1:2], w[1:2], store, index[1:2], 0.1),
                           kit.index_scores_kernel(q, w, store, index, 0.1)[1:2])
    graph, out = capture_graph(kit.index_scores_kernel, q, w, store, index, 0.1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kit.index_scores_kernel(q, w, store, index, 0.1))


@pytest.mark.parametrize("n,width,k", [(1, 32768, 512), (64, 4096, 512), (256, 1000, 512), (3, 131072, 512),
                                       (8, 16384, 2048), (1, 300, 512), (16, 700, 512), (4, 2048, 512),
                                       (1, 4096, 1024)])
def test_top_k_equals_the_stable_sort(n, width, k):
    """Integer outputs of the same scores: exactly the reference's selection and order, with FP4-like ties. Rows
    with at most k finite scores (300, 700 x 70%) take them all without the radix select; up to 4096 keys stay in
    registers."""
    from deepinfer.kernels import indexer as ki
    from deepinfer.kernels import indexer_triton as kit
    g = torch.Generator(device="cuda").manual_seed(width + n)
    scores = torch.randint(-8, 9, (n, width), device="cuda", generator=g).float() * 0.25
    scores[torch.rand(n, width, device="cuda", generator=g) < 0.3] = float("-inf")
    assert torch.equal(kit.top_k_kernel(scores, k), ki._top_k_indices(scores, k))          # the kernel itself
    assert torch.equal(kit.top_k_indices_triton(scores, k), ki._top_k_indices(scores, k))  # the op's choice
    graph, out = capture_graph(kit.top_k_kernel, scores, k)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ki._top_k_indices(scores, k))
