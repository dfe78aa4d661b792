"""kernels/indexer_triton.py in Triton's interpreter against the reference `sparse_index_scores` on fresh random
inputs: V4's 64 index heads x 128 and V4.1's 32 x 128, the tiny presets' 32 x 64 / 32 x 32, -1 candidates, K not
a multiple of the block, a row with no candidate, fp32 and fp16; top-k of the kernel's scores equals top-k of the
reference's where no near-tie separates them."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import indexer as ki
from deepinfer.kernels import indexer_triton as kit

BOUND = {torch.float32: 1e-6, torch.float16: 2e-3}    # max |kernel - reference| / max |reference| per row


def inputs(n, h, di, m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, h, di, generator=g).to(dtype)
    w = torch.randn(n, h, generator=g)
    store = torch.randn(m, di, generator=g).to(dtype)
    index = torch.randint(0, m, (n, k), generator=g)
    index[torch.rand(n, k, generator=g) < 0.2] = -1
    index[0] = -1
    return q, w, store, index


@pytest.mark.parametrize("n,h,di,m,k", [(3, 64, 128, 300, 200), (4, 32, 128, 100, 64), (2, 32, 64, 50, 37),
                                        (5, 32, 32, 40, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(n, h, di, m, k, dtype):
    q, w, store, index = inputs(n, h, di, m, k, dtype, seed=n + k)
    assert kit.supported(q, w, store, index)
    scale = di ** -0.5
    want = ki._sparse_index_scores(q.float(), w, store.float(), index, scale)
    got = kit.sparse_index_scores_triton(q, w, store, index, scale)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and bool(torch.isinf(got[0]).all())
    finite = torch.isfinite(want)
    err = ((got - want).abs().where(finite, 0).amax(-1) / want.abs().where(finite, 0).amax(-1).clamp_min(1e-30))
    assert float(err[1:].max()) <= BOUND[dtype], err
    if dtype == torch.float32:
        a, b = ki._top_k_indices(got, 8), ki._top_k_indices(want, 8)
        gaps = want.sort(-1, descending=True).values.diff(dim=-1).abs()[:, :9].nan_to_num(1.0)
        clear = (gaps > 1e-4).all(-1)                                  # rows with no near-tie around the top 8
        assert torch.equal(a[clear], b[clear])


def test_row_alone_equals_row_in_batch():
    q, w, store, index = inputs(7, 32, 128, 90, 100, torch.float32, seed=4)
    full = kit.index_scores_kernel(q, w, store, index, 0.1)
    assert torch.equal(full[3:4], kit.index_scores_kernel(q[3:4], w[3:4], store, index[3:4], 0.1))


def test_unsupported_falls_back():
    q, w, store, index = inputs(3, 32, 64, 50, 20, torch.float64, seed=2)
    assert not kit.supported(q, w, store, index)
    assert torch.equal(kit.sparse_index_scores_triton(q, w, store, index, 0.3),
                       ki._sparse_index_scores(q, w, store, index, 0.3))


def _tied_scores(n, k, seed):
    """Scores on a coarse grid (FP4-like: many exact ties), -inf holes, an all -inf row, negative and zero values."""
    g = torch.Generator().manual_seed(seed)
    s = (torch.randint(-6, 7, (n, k), generator=g).float() * 0.5)
    s[torch.rand(n, k, generator=g) < 0.2] = float("-inf")
    s[0] = float("-inf")
    if n > 2:
        s[2, : k // 2] = float("-inf")
    return s


@pytest.mark.parametrize("n,width,k", [(4, 100, 8), (3, 2500, 512), (5, 37, 64), (2, 1024, 1024), (3, 3000, 1),
                                        (4, 300, 250), (3, 9000, 64)])
def test_top_k_equals_the_stable_sort(n, width, k):
    """Exactly the reference's selection and order (integer outputs), ties to the lower position. Widths up to
    4096 keep the row in registers, 9000 walks tiles; (300, 250): most rows have fewer finite scores than k (the
    path without the radix select), as have k >= width."""
    scores = _tied_scores(n, width, seed=width + k)
    scores[1] = torch.randn(width, generator=torch.Generator().manual_seed(1))       # a row without ties
    assert kit.top_k_supported(scores, k)
    want = ki._top_k_indices(scores, k)
    assert torch.equal(kit.top_k_kernel(scores, k), want)              # the kernel, whatever the op would pick
    assert torch.equal(kit.top_k_indices_triton(scores, k), want)      # the op (few wide rows: the stable sort)


def test_signed_zeros_tie_as_the_sort():
    """-0.0 and +0.0 are one value to the stable sort (index order among them); the kernel's ordered key too."""
    scores = torch.tensor([[1.0, -0.0, 0.0, -0.0, 0.0, -1.0], [-0.0, -0.0, 0.0, float("-inf"), 0.0, -0.0]])
    for k in (1, 3, 5):
        assert torch.equal(kit.top_k_kernel(scores, k), ki._top_k_indices(scores, k)), k


def test_few_wide_rows_take_the_sort():
    """The op sends fewer than SORT_ROWS rows wider than SORT_WIDTH to the stable sort (one program a row is a
    latency chain there), everything else to the kernel; the choice depends on the shape only."""
    wide = torch.zeros(kit.SORT_ROWS - 1, kit.SORT_WIDTH + 1)
    assert kit.sort_is_faster(wide)
    assert not kit.sort_is_faster(torch.zeros(kit.SORT_ROWS, kit.SORT_WIDTH + 1))
    assert not kit.sort_is_faster(torch.zeros(1, kit.SORT_WIDTH))
