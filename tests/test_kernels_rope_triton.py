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


@pytest.mark.parametrize("n", [1, 16, 256, 8192])
def test_angles_match_torch(n):
    """rope_angles: the tables of n positions up to 2^20 at V4.1's YaRN frequencies against torch's cos / sin of the
    same fp32 products (libdevice's cosf / sinf against torch's CUDA ones: within 2e-7, and counted how many differ at
    all), and in a captured graph on new positions."""
    from deepinfer.config.deepseek_v4 import YarnScaling
    from deepinfer.kernels import rope as kr
    from deepinfer.kernels import rope_triton as krt
    from deepinfer.models.common.rope import rope_inv_freq
    inv = rope_inv_freq(64, 10000.0, YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0,
                                                 beta_slow=1.0)).cuda()
    g = torch.Generator(device="cuda").manual_seed(n)
    positions = torch.randint(0, 1 << 20, (n,), device="cuda", generator=g)
    (cos, sin), (want_cos, want_sin) = krt.rope_angles_triton(positions, inv), kr._rope_angles(positions, inv)
    assert float((cos - want_cos).abs().max()) <= 2e-7 and float((sin - want_sin).abs().max()) <= 2e-7
    print(f"n={n}: {int((cos != want_cos).sum() + (sin != want_sin).sum())} of {2 * cos.numel()} values differ")
    graph, (graph_cos, graph_sin) = capture_graph(lambda: krt.rope_angles_triton(positions, inv))
    positions.copy_(torch.randint(0, 1 << 20, (n,), device="cuda", generator=g))
    graph.replay()
    torch.cuda.synchronize()
    want_cos, want_sin = kr._rope_angles(positions, inv)
    assert float((graph_cos - want_cos).abs().max()) <= 2e-7 and float((graph_sin - want_sin).abs().max()) <= 2e-7
