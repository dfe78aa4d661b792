"""kernels/rope_triton.py on a CUDA device (`-m gpu`): bf16 and fp32 query heads [N, 64, 512] and keys [N, 512]
with the 64-channel slice, forward and inverse, against the reference (bound ROPE_BOUND of max; the copied
channels bitwise), CUDA-graph capture. Passing it is what puts the kernel in the Triton sets
(kernels/registry.py OPS)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROPE_BOUND = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,inverse", [((1, 64, 512), False), ((300, 64, 512), True), ((256, 512), False)])
def test_matches_reference(dtype, shape, inverse):
    from deepinfer.kernels import rope as kr
    from deepinfer.kernels import rope_triton as krt
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    angle = torch.rand(shape[0], 32, device="cuda", generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    assert krt.supported(x, cos, sin)
    got, want = krt.rope_kernel(x, cos, sin, inverse), kr._rope(x, cos, sin, inverse)
    assert got.dtype == dtype
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) <= ROPE_BOUND[dtype]
    assert torch.equal(got[..., :-64], x[..., :-64])
    graph, out = capture_graph(lambda a: krt.rope_kernel(a, cos, sin, inverse), x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
