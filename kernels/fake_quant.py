"""The models' quantization-aware fake-quant as ops (engine/models/qat.py, csa2.py, attention_v41.py), so a backend
can run them as one kernel: `qat_fp8` = quant.fake_quant_fp8 (ue8m0 scale per `block`), `qat_fp4` =
quant.fake_quant_fp4 (e2m1 per `block`, ue8m0 or e4m3 scales), `qat_index` = fake_quant_fp4 of
quant.hadamard_rotate (V4's indexer q and k). The reference is kernels/quant.py's math; the
Triton sets' are kernels/fake_quant_triton.py, bit for bit the same."""

from __future__ import annotations

import torch

from .quant import fake_quant_fp4, fake_quant_fp8, hadamard_rotate
from .registry import call


def qat_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., n] -> x on the e4m3 grid per `block` channels (power-of-two scales), same shape and dtype."""
    return call("qat_fp8")(x, block)


def qat_fp4(x: torch.Tensor, block: int, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """x [..., n] -> x on the e2m1 grid per `block` channels (scale_fmt: ue8m0 or e4m3 scales)."""
    return call("qat_fp4")(x, block, scale_fmt)


def qat_index(x: torch.Tensor, block: int) -> torch.Tensor:
    """V4's indexer q / k QAT: hadamard_rotate(x) on the e2m1 grid per `block` (ue8m0 scales)."""
    return call("qat_index")(x, block)


def _qat_index(x, block):
    return fake_quant_fp4(hadamard_rotate(x), block)


def _qat_fp8(x, block):
    return fake_quant_fp8(x, block)


def _qat_fp4(x, block, scale_fmt):
    return fake_quant_fp4(x, block, scale_fmt)
