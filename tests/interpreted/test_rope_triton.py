"""kernels/rope_triton.py in Triton's interpreter against the reference RoPE on fresh random inputs: query heads
[N, H, 512] with a 64-channel slice, keys [N, 512], the whole row rotary, inverse; the channels outside the slice
copied bitwise."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import rope as kr
from deepinfer.kernels import rope_triton as krt

BOUND = 1e-6     # max |kernel - reference| / max |reference|


@pytest.mark.parametrize("shape,half,inverse", [((3, 4, 512), 32, False), ((5, 512), 32, True), ((2, 3, 64), 32, False),
                                                ((7, 2, 96), 16, True)])
def test_matches_reference(shape, half, inverse):
    g = torch.Generator().manual_seed(sum(shape) + half)
    x = torch.randn(*shape, generator=g)
    angle = torch.rand(shape[0], half, generator=g) * 6.3
    cos, sin = angle.cos(), angle.sin()
    assert krt.supported(x, cos, sin)
    got, want = krt.rope_triton(x, cos, sin, inverse), kr._rope(x, cos, sin, inverse)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max() / want.abs().max()) <= BOUND
    assert torch.equal(got[..., :-2 * half], x[..., :-2 * half])


def test_unsupported_falls_back():
    x = torch.randn(2, 3, 9)                     # an odd channel count before the slice
    cos = sin = torch.ones(2, 2)
    assert not krt.supported(x, cos, sin)
    assert torch.equal(krt.rope_triton(x, cos, sin, False), kr._rope(x, cos, sin, False))


@pytest.mark.parametrize("n,half,top", [(1, 32, 8192), (17, 16, 1 << 20), (300, 32, 65536), (4, 48, 100)])
def test_angles_match_reference(n, half, top):
    """rope_angles: the fp32 product position * inv_freq, then cos and sin (numpy's in the interpreter, libdevice's
    on the GPU; torch's CPU functions may differ from numpy's in the last bit)."""
    from deepinfer.models.common.rope import rope_inv_freq
    from deepinfer.config.deepseek_v4 import YarnScaling
    g = torch.Generator().manual_seed(n + half)
    positions = torch.randint(0, top, (n,), generator=g)
    inv = rope_inv_freq(2 * half, 10000.0, YarnScaling(factor=16.0, original_max_position_embeddings=65536,
                                                       beta_fast=32.0, beta_slow=1.0) if n % 2 else None)
    (cos, sin), (want_cos, want_sin) = krt.rope_angles_triton(positions, inv), kr._rope_angles(positions, inv)
    assert cos.shape == sin.shape == (n, half) and cos.dtype == torch.float32
    assert float((cos - want_cos).abs().max()) <= 2e-7 and float((sin - want_sin).abs().max()) <= 2e-7
