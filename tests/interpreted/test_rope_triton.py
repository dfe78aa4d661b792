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
