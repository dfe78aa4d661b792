"""kernels/softmax_pool_triton.py in Triton's interpreter against the reference `softmax_pool` on fresh random
inputs: V4.1's 4-slot groups, V4's 8-slot overlapped and 128-slot windows, a -inf slot and the lowest finite score
(a window's missing slots), channel counts off the block, strided inputs, and float64 on the reference."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import softmax_pool_triton as ks
from deepinfer.kernels.softmax_pool import _softmax_pool, softmax_pool
from deepinfer.kernels.table import use


@pytest.fixture(autouse=True)
def _kernels_interpreted():
    assert ks.INTERPRETED, "triton was imported before TRITON_INTERPRET=1: the functions would run the reference"


@pytest.mark.parametrize("n,s,d", [(1, 4, 512), (7, 8, 512), (3, 128, 640), (5, 3, 33)])
def test_pool_equals_the_reference(n, s, d):
    g = torch.Generator().manual_seed(n * s + d)
    kv, score = torch.randn(n, s, d, generator=g), torch.randn(n, s, d, generator=g) * 4
    score[0, 0] = torch.finfo(torch.float32).min                         # a missing slot: weighs 0
    if s > 1:
        score[-1, -1, : d // 2] = float("-inf")
    want, got = _softmax_pool(kv, score), ks.softmax_pool_triton(kv, score)
    assert got.dtype == torch.float32 and got.shape == (n, d)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    with use("triton") as table:
        assert table.backends["softmax_pool"] == "triton"
        torch.testing.assert_close(softmax_pool(kv, score), want, rtol=2e-6, atol=2e-6)


def test_strided_inputs_and_float64():
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(4, 8, 2 * 96, generator=g)
    kv, score = wide[..., :96], wide[..., 96:]                            # V4's halves: row strides of the whole
    torch.testing.assert_close(ks.softmax_pool_triton(kv, score), _softmax_pool(kv, score), rtol=2e-6, atol=2e-6)
    kv64, score64 = kv.double(), score.double()
    assert torch.equal(ks.softmax_pool_triton(kv64, score64), _softmax_pool(kv64, score64))
