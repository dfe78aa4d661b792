"""kernels/norm_triton.py in Triton's interpreter against the reference RMSNorm on fresh random inputs: hidden
widths (4096, 5120), a q-norm head dim (512, unweighted, [N, H, d] rows), widths not a power of two, rows not a
multiple of the row block; a row's bits the same alone and inside a batch."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import norm as kn
from deepinfer.kernels import norm_triton as knt

BOUND = 1e-6     # max |kernel - reference| / max |reference|


@pytest.mark.parametrize("shape,weighted", [((3, 4096), True), ((5, 5120), True), ((2, 7, 512), False),
                                            ((19, 96), True), ((1, 100), False)])
def test_matches_reference(shape, weighted):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g) if weighted else None
    assert knt.supported(x, w)
    got, want = knt.rms_norm_triton(x, w, 1e-6), kn._rms_norm(x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert float((got - want).abs().max() / want.abs().max()) <= BOUND


def test_a_row_keeps_its_bits_in_any_batch():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(640, generator=g)
    row = torch.randn(1, 640, generator=g)
    alone = knt.rms_norm_triton_invariant(row, w, 1e-6)
    batch = torch.randn(21, 640, generator=g)
    batch[13] = row[0]
    assert torch.equal(knt.rms_norm_triton_invariant(batch, w, 1e-6)[13], alone[0])


def test_unsupported_falls_back():
    x = torch.randn(2, knt.MAX_N + 1, dtype=torch.float64)
    assert not knt.supported(x, None)
    assert torch.equal(knt.rms_norm_triton(x, None, 1e-6), kn._rms_norm(x, None, 1e-6))
