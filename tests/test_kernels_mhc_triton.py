"""kernels/mhc_triton.py on a CUDA device (`-m gpu`): the fused hc_mixes kernel at released widths (hc 4 x 4096,
4 x 5120; bf16 streams, fp32 weights) against the reference on random inputs, both orders of work (the chunk
kernel first or not) and, from GEMM_ROWS rows (n = 2048 here), the `triton` set's cuBLAS projection, any row
alone = the row in a batch (bitwise, triton_invariant), CUDA-graph capture.
Bound: max |kernel - reference| / max |reference| <= GPU_BOUND for pre, post, comb (fp32 throughout; the
reference's F.linear runs without TF32 here). Passing this keeps the kernel in the Triton sets
(kernels/registry.py OPS). CPU: tests/interpreted/test_mhc_triton.py."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_BOUND = 1e-5


@pytest.mark.parametrize("d", [4096, 5120])
@pytest.mark.parametrize("n", [1, 16, 100, 2048])
def test_matches_reference(d, n):
    from deepinfer.kernels import mhc as km
    from deepinfer.kernels import mhc_triton as kmt
    g = torch.Generator(device="cuda").manual_seed(n + d)
    streams = torch.randn(n, 4, d, device="cuda", generator=g).bfloat16()
    fn = torch.randn(24, 4 * d, device="cuda", generator=g) * (4 * d) ** -0.5
    base = torch.randn(24, device="cuda", generator=g) * 0.3
    scale = torch.randn(3, device="cuda", generator=g) * 0.3 + 1.0
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        want = km._hc_mixes(streams, fn, base, scale, 1e-6, 1e-6, 20)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    got = kmt.hc_mixes_triton(streams, fn, base, scale, 1e-6, 1e-6, 20)
    for a, b in zip(got, want):
        assert float((a - b).abs().max() / b.abs().max()) <= GPU_BOUND
    for split in (True, False):         # chunk programs first, or each row block walking its chunks
        both = kmt.hc_mixes_kernel(streams, fn, base, scale, 1e-6, 1e-6, 20, split=split)
        for a, b in zip(both, want):
            assert float((a - b).abs().max() / b.abs().max()) <= GPU_BOUND, split
    if n > 1:                           # triton_invariant: any row alone = the row in the batch, bitwise
        full = kmt.hc_mixes_triton_invariant(streams, fn, base, scale, 1e-6, 1e-6, 20)
        alone = kmt.hc_mixes_triton_invariant(streams[n - 1:], fn, base, scale, 1e-6, 1e-6, 20)
        assert all(torch.equal(a[n - 1:], b) for a, b in zip(full, alone))
    graph, out = capture_graph(kmt.hc_mixes_triton, streams, fn, base, scale, 1e-6, 1e-6, 20)   # got's path
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out, got))
