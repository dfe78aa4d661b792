"""kernels/mhc_triton.py's row kernels in Triton's interpreter against the reference hc_collapse / hc_post on fresh
random inputs: the tiny width (hc 4 x 64), a released width (hc 4 x 5120: several column blocks), hc 2 and 8, rows of
any count; a row's bits the same alone and inside a batch."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import mhc as km
from deepinfer.kernels import mhc_triton as kr

BOUND = 1e-6     # max |kernel - reference| / max |reference|


def inputs(n, hc, d, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hc, d, generator=g)
    f = torch.randn(n, d, generator=g)
    pre = torch.rand(n, hc, generator=g)
    post = 2 * torch.rand(n, hc, generator=g)
    comb = torch.softmax(torch.randn(n, hc, hc, generator=g), -1)
    return h, f, pre, post, comb


@pytest.mark.parametrize("n,hc,d", [(5, 4, 64), (3, 4, 5120), (7, 2, 48), (2, 8, 96)])
def test_matches_reference(n, hc, d):
    h, f, pre, post, comb = inputs(n, hc, d, seed=n * hc + d)
    assert kr.rows_supported(h, pre)
    for got, want in ((kr.hc_collapse_triton(h, pre), km._hc_collapse(h, pre)),
                      (kr.hc_post_triton(f, h, post, comb), km._hc_post(f, h, post, comb))):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert float((got - want).abs().max() / want.abs().max()) <= BOUND


def test_a_row_keeps_its_bits_in_any_batch():
    h, f, pre, post, comb = inputs(19, 4, 200, seed=1)
    one = [t[6:7] for t in (h, f, pre, post, comb)]
    assert torch.equal(kr.hc_collapse_triton_invariant(h, pre)[6], kr.hc_collapse_triton_invariant(one[0], one[2])[0])
    assert torch.equal(kr.hc_post_triton_invariant(f, h, post, comb)[6],
                       kr.hc_post_triton_invariant(one[1], one[0], one[3], one[4])[0])


def test_unsupported_falls_back():
    h, f, pre, post, comb = (t.double() for t in inputs(3, 4, 32, seed=2))
    assert not kr.rows_supported(h, pre)
    assert torch.equal(kr.hc_post_triton(f, h, post, comb), km._hc_post(f, h, post, comb))
