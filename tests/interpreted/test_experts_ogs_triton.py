"""kernels/experts_ogs_triton.py's one kernel of its own in Triton's interpreter: the gated activation between the
matmul_ogs GEMMs (h = r * swiglu(gate, up, limit)) against kernels/experts.py's swiglu times r, with and without
the clamp, over widths that are and are not multiples of the block. fp32 here (the interpreter has no bf16)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.experts import swiglu
from deepinfer.kernels.experts_ogs_triton import gated_activation


@pytest.mark.parametrize("m,n", [(1, 64), (5, 1000), (3, 2304)])
@pytest.mark.parametrize("limit", [0.0, 1.5])
def test_gated_activation_equals_swiglu_times_r(m, n, limit):
    gen = torch.Generator().manual_seed(m * n)
    gate, up = torch.randn(m, n, generator=gen) * 3, torch.randn(m, n, generator=gen) * 3
    r = torch.rand(m, generator=gen)
    want = swiglu(gate, up, limit) * r.unsqueeze(-1)
    got = gated_activation(gate, up, r, limit)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    gate_up = torch.cat([gate, up], dim=1)                 # the joined GEMM's output: halves as strided views
    assert torch.equal(gated_activation(gate_up[:, :n], gate_up[:, n:], r, limit), got)
    assert gated_activation(gate[:0], up[:0], r[:0], limit).shape == (0, n)
