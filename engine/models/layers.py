"""Parameter-holding building blocks shared by every model family."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.kernels.matmul import linear
from deepinfer.kernels.norm import rms_norm
from deepinfer.kernels.precision import upcast


@dataclass
class QuantizedWeight:
    """The on-disk quantized form of a weight, kept beside its dequantized copy for fast kernels."""
    data: torch.Tensor          # float8_e4m3fn [out, in] or int8 packed e2m1 [out, in/2]
    scale: torch.Tensor         # e8m0 or float32 block scales
    fmt: str                    # "fp8" or "fp4"
    block: tuple[int, int]      # (rows, cols) covered by one scale


class Linear(nn.Module):
    """y = x W^T with W [out, in] in the compute dtype (the reference path dequantizes on load)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.quantized: QuantizedWeight | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.to(self.weight.dtype), self.weight)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """In >= fp32 whatever the weight dtype: the LM heads (DeepSeek's reference computes logits in fp32)."""
        return linear(upcast(x), upcast(self.weight))


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight stays fp32 as in the checkpoint's reference math."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)
