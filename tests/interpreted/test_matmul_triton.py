"""kernels/matmul_triton.py (the invariant dense GEMMs on the expert kernel) in Triton's interpreter, fp32: equal
to F.linear / the grouped einsum within fp32 summation error, a row's bits alone = in a batch (and at any place
in it), zero rows, shapes that are not tile multiples, strided inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import matmul_triton as kmt


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("m,n,k", [(1, 96, 128), (70, 200, 160), (130, 64, 256)])
def test_linear_equals_reference_and_is_batch_invariant(m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
    assert kmt.supported(x, w)
    got = kmt.linear_invariant(x, w)
    assert got.shape == (m, n) and _rel(got, F.linear(x, w)) < 1e-5
    for j in {0, m // 2, m - 1}:
        assert torch.equal(kmt.linear_invariant(x[j:j + 1], w)[0], got[j])
    shuffled = torch.randperm(m, generator=g)
    assert torch.equal(kmt.linear_invariant(x[shuffled], w), got[shuffled])


def test_linear_keeps_leading_dims_and_zero_rows():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 5, 64, generator=g), torch.randn(32, 64, generator=g)
    got = kmt.linear_invariant(x, w)
    assert got.shape == (3, 5, 32) and _rel(got, F.linear(x, w)) < 1e-5
    assert kmt.linear_invariant(x[:0], w).shape == (0, 5, 32)


@pytest.mark.parametrize("r,groups,o,i", [(1, 4, 64, 96), (37, 2, 48, 160)])
def test_grouped_equals_einsum_and_is_batch_invariant(r, groups, o, i):
    g = torch.Generator().manual_seed(r * groups)
    x = torch.randn(r, groups, i, generator=g)
    w = torch.randn(groups, o, i, generator=g) / i ** 0.5
    got = kmt.grouped_linear_invariant(x, w)
    assert got.shape == (r, groups, o) and _rel(got, torch.einsum("ngi,gri->ngr", x, w)) < 1e-5
    assert torch.equal(kmt.grouped_linear_invariant(x[r - 1:], w)[0], got[r - 1])


def test_strided_inputs():
    """A row-strided x (a slice of a wider tensor) and a grouped x taken as a transposed view."""
    g = torch.Generator().manual_seed(2)
    wide, w = torch.randn(9, 200, generator=g), torch.randn(48, 128, generator=g)
    x = wide[:, 8:136]
    assert not x.is_contiguous()
    assert _rel(kmt.linear_invariant(x, w), F.linear(x, w)) < 1e-5
    xg = torch.randn(3, 6, 64, generator=g).transpose(0, 1)                  # [6, 3, 64], not contiguous
    wg = torch.randn(3, 32, 64, generator=g)
    assert _rel(kmt.grouped_linear_invariant(xg, wg), torch.einsum("ngi,gri->ngr", xg, wg)) < 1e-5


def test_float64_takes_the_tiles():
    x, w = torch.randn(4, 32, dtype=torch.float64), torch.randn(8, 32, dtype=torch.float64)
    assert not kmt.supported(x, w)
    assert torch.allclose(kmt.linear_invariant(x, w), F.linear(x, w))
