"""kernels/gather_triton.py in Triton's interpreter against the reference `gather_rows` (kernels/gather.py) on
fresh random inputs: the same bits, rows from the ring, from the step's rows and the fill, fp32 / bf16 and int64
stores, widths of 1 and not a multiple of a block, a plain tensor store, and a store with no step rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import gather_triton as kg
from deepinfer.kernels.attention import SplitStore
from deepinfer.kernels.gather import _gather_rows


@pytest.fixture(autouse=True)
def _kernels_interpreted():
    assert kg.INTERPRETED, "triton was imported before TRITON_INTERPRET=1: the functions would run the reference"


def _store(r, n, w, dtype, g):
    if dtype.is_floating_point:
        return SplitStore(torch.randn(r, w, generator=g).to(dtype), torch.randn(n, w, generator=g).to(dtype))
    return SplitStore(torch.randint(0, 1 << 40, (r, w), generator=g), torch.randint(0, 1 << 40, (n, w), generator=g))


@pytest.mark.parametrize("r,n,c,k,w", [(16, 1, 1, 8, 512), (96, 5, 5, 17, 1), (40, 9, 3, 128, 300), (8, 0, 2, 4, 64)])
@pytest.mark.parametrize("dtype,fill", [(torch.float32, torch.finfo(torch.float32).min), (torch.bfloat16, 0.0),
                                        (torch.int64, -1)])
def test_same_bits_as_the_reference(r, n, c, k, w, dtype, fill):
    g = torch.Generator().manual_seed(r * 7 + n * 5 + c * 3 + k + w)
    store = _store(r, n, w, dtype, g)
    index = torch.randint(-1, r + n, (c, k), generator=g)
    index[0, 0] = -1                                                   # the fill, a ring row and a step row in the case
    index[0, 1] = r - 1
    if n:
        index[0, -1] = r + n - 1
    want, got = _gather_rows(store, index, fill), kg.gather_rows_triton(store, index, fill)
    assert got.dtype == want.dtype == dtype and got.shape == (c, k, w)
    assert torch.equal(got, want)
    assert torch.equal(got[0, 0], torch.full((w,), fill, dtype=dtype))
    assert torch.equal(got[0, 1], store.ring[r - 1])
    if n:
        assert torch.equal(got[0, -1], store.new[n - 1])


def test_a_plain_tensor_store_and_a_cast_step():
    g = torch.Generator().manual_seed(3)
    whole = torch.randn(50, 33, generator=g)
    index = torch.randint(-1, 50, (4, 6), generator=g)
    assert torch.equal(kg.gather_rows_triton(whole, index, 0.0), _gather_rows(whole, index, 0.0))
    mixed = SplitStore(torch.randn(10, 8, generator=g), torch.randn(3, 8, generator=g, dtype=torch.float64))
    index = torch.tensor([[-1, 0, 10, 12]])
    got = kg.gather_rows_triton(mixed, index, 0.0)
    assert got.dtype == torch.float32 and torch.equal(got, _gather_rows(mixed, index, 0.0))
