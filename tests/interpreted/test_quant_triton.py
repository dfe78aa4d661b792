"""kernels/quant_triton.py's row quantizer (the kv_pack and qat backends) in Triton's interpreter: the packer's
records equal the reference's KVFormat.pack byte for byte, and the QAT fake-quant ops equal
quant.fake_quant_fp8 / fake_quant_fp4 bit for bit, every format (V4's FP8 latent with its bf16 tail, V4.1's FP8
window and FP4 / e4m3-scale entries, FP4 / ue8m0 keys), rows from 1e-8 to 1e3 (every scale range, e4m3 subnormal scales and the exact-scale search
included), QAT-rounded rows, zeros and negative zeros, one row and many."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import fake_quant_triton as kft
from deepinfer.kernels import quant_triton as kpt
from deepinfer.kernels.kv_formats import KVFormat
from deepinfer.kernels.quant import fake_quant_fp4, fake_quant_fp8

FORMATS = {"v4_latent": KVFormat("fp8", 96, 64, tail=32), "v4_latent_flash": KVFormat("fp8", 512, 64, tail=64),
           "v41_window": KVFormat("fp8", 96, 32), "v41_entry": KVFormat("fp4", 96, 16, scale="e4m3"),
           "v41_entry_flash": KVFormat("fp4", 512, 16, scale="e4m3"), "index_key": KVFormat("fp4", 128, 32)}


def rows(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g) * torch.logspace(-8, 3, n).unsqueeze(1)
    x[0, :8] = 0.0
    x[0, 8:16] = -0.0
    return x


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_records_equal_the_reference_byte_for_byte(name):
    fmt = FORMATS[name]
    assert kpt.INTERPRETED and kpt.supported(fmt, rows(2, fmt.width, 0))
    for n, seed in ((1, 1), (60, 2)):
        x = rows(n, fmt.width, seed)
        assert torch.equal(kpt.pack_kernel(fmt, x), fmt.pack(x))
    if fmt.kind == "fp4" and fmt.scale == "e4m3":            # QAT-rounded rows: the search keeps them exact
        q = fake_quant_fp4(rows(60, fmt.width, 3), fmt.block, scale_fmt="e4m3")
        got = kpt.pack_kernel(fmt, q)
        assert torch.equal(got, fmt.pack(q)) and torch.equal(fmt.unpack(got, torch.float32), q)


@pytest.mark.parametrize("kind,block,scale_fmt,width", [
    ("fp8", 64, "ue8m0", 448), ("fp8", 32, "ue8m0", 512), ("fp8", 128, "ue8m0", 512), ("fp8", 64, "ue8m0", 64),
    ("fp4", 16, "e4m3", 512), ("fp4", 16, "e4m3", 96), ("fp4", 32, "ue8m0", 128), ("fp4", 32, "ue8m0", 64)])
def test_fake_quant_equals_the_reference_bit_for_bit(kind, block, scale_fmt, width):
    """The QAT ops (kernels/fake_quant.py) on the Triton set: quant.fake_quant_fp8 (ue8m0) / fake_quant_fp4, at the
    models' widths (V4's 448 non-RoPE channels per 64, V4.1's window per 32, entries per 16, index q / k per 32)."""
    for n, seed in ((1, 4), (50, 5)):
        x = rows(n, width, seed)
        want = fake_quant_fp8(x, block) if kind == "fp8" else fake_quant_fp4(x, block, scale_fmt)
        got = kft.qat_fp8_triton(x, block) if kind == "fp8" else kft.qat_fp4_triton(x, block, scale_fmt)
        assert got.dtype == x.dtype and torch.equal(got, want)
    x3 = rows(12, width, 6).view(3, 4, width)                                   # leading dims kept
    got = kft.qat_fp8_triton(x3, block) if kind == "fp8" else kft.qat_fp4_triton(x3, block, scale_fmt)
    want = fake_quant_fp8(x3, block) if kind == "fp8" else fake_quant_fp4(x3, block, scale_fmt)
    assert got.shape == x3.shape and torch.equal(got, want)


@pytest.mark.parametrize("width", [64, 128])
def test_index_qat_equals_hadamard_then_fp4_bit_for_bit(width):
    """V4's indexer QAT (qat_index): the same butterfly as quant.hadamard_rotate, then FP4 per 32 (ue8m0)."""
    from deepinfer.kernels.fake_quant import _qat_index
    for n, seed in ((1, 7), (40, 8)):
        x = rows(n, width, seed)
        assert torch.equal(kft.qat_index_triton(x, 32), _qat_index(x, 32))
    x3 = rows(12, width, 9).view(2, 6, width)
    assert torch.equal(kft.qat_index_triton(x3, 32), _qat_index(x3, 32))
