"""kernels/moe_combine_triton.py on a CUDA device (`-m gpu`): bit for bit the reference combine at the released widths
(V4 4096, V4.1 5120; k = 6; 1..2048 rows; bf16 out with the shared expert, fp32 without), and under CUDA-graph
capture. Passing it is what puts the kernel in the Triton sets
(kernels/registry.py OPS)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("d", [4096, 5120])
@pytest.mark.parametrize("n", [1, 64, 2048])
@pytest.mark.parametrize("with_shared", [True, False])
def test_bit_for_bit_on_cuda(d, n, with_shared):
    from deepinfer.kernels import moe_combine_triton as kc
    k = 6
    g = torch.Generator(device="cuda").manual_seed(n + d)
    y = torch.randn(n * k, d, device="cuda", generator=g)
    inverse = torch.randperm(n * k, device="cuda", generator=g)
    shared = torch.randn(n, d, device="cuda", generator=g).bfloat16() if with_shared else None
    out_dtype = torch.bfloat16 if with_shared else torch.float32
    assert kc.supported(y, inverse, shared, k)
    got = kc._triton(y, inverse, k, shared, out_dtype)
    assert torch.equal(got, kc._reference(y, inverse, k, shared, out_dtype))
    graph, out = capture_graph(lambda a: kc._triton(a, inverse, k, shared, out_dtype), y)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
