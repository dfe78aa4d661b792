"""kernels/matmul_triton.py on a CUDA device (`-m gpu`): the invariant `linear` / `grouped_linear` on the expert
kernel at projection shapes (bf16) against the fp32 reference within the bf16 GEMM bound, a row's bits alone = in
a batch of 300, CUDA-graph capture. Passing it is what puts the kernel in the Triton sets
(kernels/registry.py OPS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
BOUND = 1e-2           # max |out - fp32 reference| / max |reference| (bf16 inputs and output)


@pytest.mark.parametrize("n,k", [(32768, 1280), (1024, 4096), (5120, 8192), (512, 5120)])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_linear_on_cuda(m, n, k):
    from deepinfer.kernels import matmul_triton as kmt
    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    got = kmt.linear_invariant(x, w)
    want = F.linear(x.float(), w.float())
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max() / want.abs().max()) < BOUND
    if m > 1:
        for j in (0, m - 1):
            assert torch.equal(kmt.linear_invariant(x[j:j + 1], w)[0], got[j])


def test_grouped_on_cuda():
    from deepinfer.kernels import matmul_triton as kmt
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(300, 8, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(8, 1024, 4096, device="cuda", generator=g) / 64).bfloat16()
    got = kmt.grouped_linear_invariant(x, w)
    want = torch.einsum("ngi,gri->ngr", x.float(), w.float())
    assert float((got.float() - want).abs().max() / want.abs().max()) < BOUND
    assert torch.equal(kmt.grouped_linear_invariant(x[7:8], w)[0], got[7])


def test_graph_capture():
    from deepinfer.kernels import matmul_triton as kmt
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(16, 1024, device="cuda", generator=g).bfloat16()
    w = torch.randn(2048, 1024, device="cuda", generator=g).bfloat16()
    want = kmt.linear_invariant(x, w)
    graph, out = capture_graph(lambda a: kmt.linear_invariant(a, w), x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
