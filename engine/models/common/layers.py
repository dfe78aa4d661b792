"""Parameter-holding building blocks shared by every model family."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.kernels.fp8_linear import fp8_linear
from deepinfer.kernels.matmul import grouped_linear, linear, linear_f32
from deepinfer.kernels.norm import rms_norm
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.quant import dequantize_fp8_blocks

PROJECTION_STORAGE = ("dense", "fp8")      # how projections FP8 in the release are held (models.build_model)


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

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the output."""
        return self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x.to(self.weight.dtype), self.weight)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, G, in/G] -> [N, G, out/G]: group g of every row times rows g*out/G.. of W (V4's grouped wo_a)."""
        w = self.weight.view(x.shape[1], -1, x.shape[-1])                        # [G, out/G, in/G]
        return grouped_linear(x.to(w.dtype), w)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        """In >= fp32 whatever the weight dtype: the LM heads (DeepSeek's reference computes logits in fp32)."""
        return linear_f32(x, self.weight)


class Fp8Linear(nn.Module):
    """y = x W^T with W kept as the release stores it (projection_storage="fp8"): weight float8_e4m3fn [out, in]
    and one float32 scale per block x block (V4: 128, V4.1: 32), scale [ceil(out/block), ceil(in/block)]
    (checkpoint names `.weight`, `.scale`). Runs `fp8_linear`: DeepSeek's W8A8 recipe, the activations quantized
    to e4m3 per 1 x block with power-of-two scales, fp32 accumulation, output in the compute dtype. Half the
    bytes of a bf16 weight."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, block: int):
        super().__init__()
        self.in_features, self.out_features, self.dtype, self.block = in_features, out_features, dtype, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(-(-out_features // block), -(-in_features // block),
                                              dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x.to(self.dtype), self.weight, self.scale, self.dtype, self.block)

    def fp32(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(upcast(x), self.weight, self.scale, torch.float32, self.block)

    def dequantized(self) -> torch.Tensor:
        """W [out, in] in the compute dtype (exact: e4m3 values times powers of two fit bf16)."""
        return dequantize_fp8_blocks(self.weight, self.scale, (self.block, self.block), self.dtype)

    @property
    def quantized(self) -> QuantizedWeight:
        """The on-disk form (what keep_quantized attaches to a dense Linear): here the module's own tensors."""
        return QuantizedWeight(self.weight, self.scale, "fp8", (self.block, self.block))


def fp8_projections(model: nn.Module, is_fp8, block: int, keep_dense: tuple[str, ...] = ()) -> list[str]:
    """Swap every Linear whose `<name>.weight` is FP8 in the release (`is_fp8(checkpoint name)`) for an Fp8Linear
    of the same shape and compute dtype, in place, before the weights are allocated (meta device) or loaded;
    names ending in one of `keep_dense` stay dense. Returns the swapped module names."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or not is_fp8(f"{name}.weight") or name.endswith(keep_dense):
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                Fp8Linear(module.in_features, module.out_features, module.weight.dtype, block))
        swapped.append(name)
    return swapped


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
