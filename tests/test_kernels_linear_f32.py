"""kernels/matmul.linear_f32's triton backend on a CUDA device (`-m gpu`): bf16 x and w at LM-head and
compressor shapes through one cuBLAS GEMM with an fp32 output (torch.mm out_dtype), against the reference (both
operands upcast to fp32, TF32 off): products of bf16 values are exact in fp32, so only the summation order
differs. Bound: max |kernel - reference| / max |reference| <= GPU_BOUND. Also: no fp32 copy of the weight is made
(peak memory), CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_BOUND = 1e-5


@pytest.mark.parametrize("n", [1, 16, 300])
@pytest.mark.parametrize("vocab,dim", [(129280, 4096), (512, 5120)])
def test_matches_reference(n, vocab, dim):
    from deepinfer.kernels import matmul
    g = torch.Generator(device="cuda").manual_seed(n + dim)
    x = torch.randn(n, dim, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, dim, device="cuda", generator=g) * dim ** -0.5).bfloat16()
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = matmul._linear_f32(x, w)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = matmul._linear_f32_mixed(x, w)
    torch.cuda.synchronize()
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) <= GPU_BOUND
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < w.numel() * 2, extra                  # the output (and workspace), not an fp32 copy of w
    graph, out = capture_graph(matmul._linear_f32_mixed, x, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)


def test_invariant_rows_keep_their_bits_at_every_batch_position():
    """The invariant backend on CUDA (fp32-output cuBLAS on fixed 64-row tiles): a row's logits are the same bits
    alone and at any position of batches of 5, 64 and 200 rows, and within GPU_BOUND of the reference."""
    from deepinfer.kernels import matmul
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(129280, 4096, device="cuda", generator=g) * 4096 ** -0.5).bfloat16()
    row = torch.randn(1, 4096, device="cuda", generator=g).bfloat16()
    alone = matmul._linear_f32_tiles(row, w)
    for n, at in ((5, 3), (64, 63), (200, 130)):
        batch = torch.randn(n, 4096, device="cuda", generator=g).bfloat16()
        batch[at] = row[0]
        assert torch.equal(matmul._linear_f32_tiles(batch, w)[at], alone[0]), (n, at)
    want = matmul._linear_f32(row, w)
    assert float((alone - want).abs().max() / want.abs().max()) <= GPU_BOUND
