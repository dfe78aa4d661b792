"""kernels/norm_triton.py on a CUDA device (`-m gpu`): bf16 and fp32 rows at the released widths against the
reference RMSNorm (bound NORM_BOUND of max; bf16 outputs one rounding apart), a row's bits alone and inside
batches of 7 and 300, CUDA-graph capture. Passing it is what puts the kernel in the Triton sets
(kernels/registry.py OPS)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
NORM_BOUND = {torch.float32: 1e-6, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,weighted", [((1, 4096), True), ((256, 5120), True), ((64, 64, 512), False)])
def test_matches_reference_and_rows_keep_their_bits(dtype, shape, weighted):
    from deepinfer.kernels import norm as kn
    from deepinfer.kernels import norm_triton as knt
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    x = (torch.randn(*shape, device="cuda", generator=g) * 3).to(dtype)
    w = torch.randn(shape[-1], device="cuda", generator=g).to(dtype) if weighted else None
    assert knt.supported(x, w)
    got, want = knt.rms_norm_kernel(x, w, 1e-6), kn._rms_norm(x, w, 1e-6)
    assert got.dtype == dtype
    assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) <= NORM_BOUND[dtype]
    rows = x.reshape(-1, shape[-1])
    for n, at in ((7, 5), (300, 131)):
        batch = torch.randn(n, shape[-1], device="cuda", generator=g).to(dtype)
        batch[at] = rows[0]
        assert torch.equal(knt.rms_norm_kernel(batch, w, 1e-6)[at], knt.rms_norm_kernel(rows[:1], w, 1e-6)[0])
    graph, out = capture_graph(lambda a: knt.rms_norm_kernel(a, w, 1e-6), x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
