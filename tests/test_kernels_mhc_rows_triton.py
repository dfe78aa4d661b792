"""kernels/mhc_triton.py's row kernels on a CUDA device (`-m gpu`): hc_collapse and hc_post with bf16 and fp32
streams at the released widths (hc 4 x 4096 / 5120) against the reference (bound ROWS_BOUND of max; bf16 outputs one
rounding apart), a row's bits alone and inside batches of 7 and 300, CUDA-graph capture. Passing it is what
keeps them in the Triton sets (kernels/registry.py OPS)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROWS_BOUND = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


def _inputs(n, d, dtype, g):
    h = torch.randn(n, 4, d, device="cuda", generator=g).to(dtype)
    f = torch.randn(n, d, device="cuda", generator=g).to(dtype)
    pre = torch.rand(n, 4, device="cuda", generator=g)
    post = 2 * torch.rand(n, 4, device="cuda", generator=g)
    comb = torch.softmax(torch.randn(n, 4, 4, device="cuda", generator=g), -1)
    return h, f, pre, post, comb


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d", [(1, 4096), (256, 5120)])
def test_matches_reference_and_rows_keep_their_bits(dtype, n, d):
    from deepinfer.kernels import mhc as km
    from deepinfer.kernels import mhc_triton as kr
    g = torch.Generator(device="cuda").manual_seed(n + d)
    h, f, pre, post, comb = _inputs(n, d, dtype, g)
    assert kr.rows_supported(h, f, pre, post, comb)
    got = (kr.hc_collapse_kernel(h, pre), kr.hc_post_kernel(f, h, post, comb))
    want = (km._hc_collapse(h, pre), km._hc_post(f, h, post, comb))
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        assert float((a.float() - b.float()).abs().max() / b.float().abs().max()) <= ROWS_BOUND[dtype]
    for m, at in ((7, 5), (300, 131)):
        hb, fb, preb, postb, combb = _inputs(m, d, dtype, g)
        for t, src in ((hb, h), (fb, f), (preb, pre), (postb, post), (combb, comb)):
            t[at] = src[0]
        assert torch.equal(kr.hc_collapse_kernel(hb, preb)[at], got[0][0])
        assert torch.equal(kr.hc_post_kernel(fb, hb, postb, combb)[at], got[1][0])
    graph, out = capture_graph(kr.hc_post_kernel, f, h, post, comb)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got[1])
