"""kernels/kv_pack_triton.py on a CUDA device (`-m gpu`): the packer's records equal the reference's
KVFormat.pack byte for byte for the released records (V4 584 B, V4.1 528 / 288 B, index keys 68 B), bf16 and
fp32 rows at every scale range, one row and 4096, and under CUDA-graph capture. Passing it flips
kernels/kv_pack_triton.IN_TRITON_SETS. CPU: tests/interpreted/test_kv_pack_triton.py."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.kv_formats import INDEX_KEY, V4_LATENT, V41_ENTRY, V41_WINDOW
from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("fmt", [V4_LATENT, V41_WINDOW, V41_ENTRY, INDEX_KEY], ids=["v4", "v41w", "v41e", "idx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 4096])
def test_records_equal_the_reference(fmt, dtype, n):
    from deepinfer.kernels import kv_pack_triton as kpt
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(n, fmt.width, device="cuda", generator=g)
         * torch.logspace(-8, 3, n, device="cuda").unsqueeze(1)).to(dtype)
    assert kpt.supported(fmt, x)
    got = kpt.pack_kernel(fmt, x)
    want = fmt.pack(x)
    assert torch.equal(got, want), int((got != want).sum())
    graph, out = capture_graph(lambda a: kpt.pack_kernel(fmt, a), x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
