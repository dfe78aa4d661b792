"""Triton `qat_fp8`, `qat_fp4` and `qat_index` (the contracts: kernels/fake_quant.py) for both Triton sets: the row
quantizer of kernels/quant_triton.py in its values mode, one launch per call, bit for bit the reference
(tests/interpreted/test_quant_triton.py); `qat_index` runs V4's indexer Hadamard butterfly first, the reference's
pairs in fp32. Row-local, so invariant as they are.
"""

from __future__ import annotations

import torch

from .fake_quant import _qat_index
from .quant import fake_quant_fp4, fake_quant_fp8
from .quant_triton import fake_quant_kernel, fake_quant_supported


def _on_rows(x: torch.Tensor, block: int, kernel, fallback, extra_ok: bool = True) -> torch.Tensor:
    """x [..., n] as rows [M, n] through kernel (a fake-quant launch), or fallback(x) where the kernel does not run."""
    flat = x.reshape(-1, x.shape[-1])
    if not (extra_ok and fake_quant_supported(flat, block)):
        return fallback(x)
    return kernel(flat).view(x.shape)


def qat_fp8_triton(x: torch.Tensor, block: int) -> torch.Tensor:
    return _on_rows(x, block, lambda f: fake_quant_kernel(f, "fp8", block), lambda t: fake_quant_fp8(t, block))


def qat_fp4_triton(x: torch.Tensor, block: int, scale_fmt: str) -> torch.Tensor:
    return _on_rows(x, block, lambda f: fake_quant_kernel(f, "fp4", block, scale_fmt),
                    lambda t: fake_quant_fp4(t, block, scale_fmt))


def qat_index_triton(x: torch.Tensor, block: int) -> torch.Tensor:
    """The butterfly needs n and n / block powers of two."""
    n = x.shape[-1]
    return _on_rows(x, block, lambda f: fake_quant_kernel(f, "fp4", block, hadamard=True),
                    lambda t: _qat_index(t, block), extra_ok=not (n & (n - 1) or n // block & (n // block - 1)))
