"""kernels/quant_triton.py's row quantizer (the kv_pack and qat backends) on a CUDA device (`-m gpu`): the
packer's records equal the reference's KVFormat.pack byte for byte for the released records (V4 584 B, V4.1
528 / 288 B, index keys 68 B), and the QAT fake-quant equals quant.fake_quant_fp8 / fake_quant_fp4 bit for bit, bf16 and fp32 rows at every scale range, one row and
4096, and under CUDA-graph capture. Passing it keeps kv_pack and the qat ops in the Triton sets
(kernels/registry.py OPS). CPU: tests/interpreted/test_quant_triton.py."""

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
    from deepinfer.kernels import quant_triton as kpt
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


@pytest.mark.parametrize("kind,block,scale_fmt,width", [("fp8", 64, "ue8m0", 448), ("fp8", 32, "ue8m0", 512),
                                                        ("fp4", 16, "e4m3", 512), ("fp4", 32, "ue8m0", 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_quant_equals_the_reference(kind, block, scale_fmt, width, dtype):
    from deepinfer.kernels import fake_quant_triton as kpt
    from deepinfer.kernels.quant import fake_quant_fp4, fake_quant_fp8
    g = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(4096, width, device="cuda", generator=g)
         * torch.logspace(-8, 3, 4096, device="cuda").unsqueeze(1)).to(dtype)
    want = fake_quant_fp8(x, block) if kind == "fp8" else fake_quant_fp4(x, block, scale_fmt)
    got = kpt.qat_fp8_triton(x, block) if kind == "fp8" else kpt.qat_fp4_triton(x, block, scale_fmt)
    assert torch.equal(got, want), int((got != want).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_index_qat_equals_the_reference(dtype):
    """V4's indexer QAT in one launch (the Hadamard butterfly, then FP4 per 32) = hadamard_rotate + fake_quant_fp4."""
    from deepinfer.kernels import fake_quant_triton as kpt
    from deepinfer.kernels.fake_quant import _qat_index
    g = torch.Generator(device="cuda").manual_seed(11)
    x = (torch.randn(4096, 128, device="cuda", generator=g) * 3).to(dtype)
    got, want = kpt.qat_index_triton(x, 32), _qat_index(x, 32)
    assert torch.equal(got, want), int((got != want).sum())
