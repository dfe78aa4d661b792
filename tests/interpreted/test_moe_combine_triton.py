"""kernels/moe_combine_triton.py in Triton's interpreter against the reference combine on fresh random inputs: bit
for bit (the same fp32 additions in the same order), with and without the shared expert, bf16 and fp32 outputs, widths not
a multiple of the column block, one row, k = 1 and 6, and a random dispatch permutation."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import moe_combine_triton as kc


def _case(n, k, d, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n * k, d, generator=g)
    inverse = torch.randperm(n * k, generator=g)
    shared = torch.randn(n, d, generator=g).to(torch.bfloat16)
    return y, inverse, shared


@pytest.mark.parametrize("n,k,d", [(1, 6, 4096), (5, 6, 1500), (3, 1, 64), (17, 8, 1024)])
@pytest.mark.parametrize("with_shared", [True, False])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_bit_for_bit(n, k, d, with_shared, out_dtype):
    y, inverse, shared = _case(n, k, d, n * 100 + k * 10 + d)
    shared = shared if with_shared else None
    assert kc.supported(y, inverse, shared, k)
    got, want = kc._triton(y, inverse, k, shared, out_dtype), kc._reference(y, inverse, k, shared, out_dtype)
    assert got.dtype == want.dtype == out_dtype and got.shape == (n, d)
    assert torch.equal(got, want)


def test_float64_and_unsupported_fall_back():
    y, inverse, shared = _case(2, 3, 32, 0)
    y64 = y.double()
    assert torch.equal(kc._triton(y64, inverse, 3, None, torch.float64), kc._reference(y64, inverse, 3, None,
                                                                                         torch.float64))


def test_unsupported_inputs_take_the_reference():
    y, inverse, shared = _case(4, 2, 48, 1)
    assert not kc.supported(y.bfloat16(), inverse, shared, 2)           # expert outputs not fp32
    assert not kc.supported(y, inverse, shared.double(), 2)            # a float64 shared expert
    assert not kc.supported(y, inverse, shared[:3], 2)                 # shared rows != M / k
    got = kc._triton(y.bfloat16(), inverse, 2, shared, torch.bfloat16)
    assert torch.equal(got, kc._reference(y.bfloat16(), inverse, 2, shared, torch.bfloat16))
