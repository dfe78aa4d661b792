"""Seeded random weights that look like the release's: quantized weights hold exactly what their
FP8/FP4 export dequantizes to, bf16 tensors hold bf16-representable values, fp32 ones stay fp32."""

from __future__ import annotations

import torch

from deepinfer.kernels.quant import dequantize_fp4, dequantize_fp8_blocks, quantize_fp4, quantize_fp8_blocks

from ..config.deepseek_v4 import DeepseekV4Config
from .names import checkpoint_tensors

# Dense weights stored as FP8 blocks in the release (everything else floating stays BF16 or F32).
FP8_WEIGHTS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
               "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
               "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")
# Tensors kept in F32 in the release.
FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                 "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", "ape", "gate.bias")


def is_fp8_weight(name: str) -> bool:
    return name.endswith(FP8_WEIGHTS)


def is_fp32_tensor(name: str) -> bool:
    return name.endswith(FP32_SUFFIXES)


def _sample(name: str, shape: torch.Size, cfg: DeepseekV4Config, gen: torch.Generator, device) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device) * std + mean

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):  # distinct experts per token
        keys = torch.rand(shape[0], cfg.n_routed_experts, generator=gen, device=device)
        return keys.argsort(dim=-1)[:, : shape[1]].to(torch.long)
    if name.endswith("_fn"):
        return normal(0.5 * shape[-1] ** -0.5)
    if name.endswith(("_base", "_scale")) and "hc_" in name:
        return normal(0.3, 1.0 if leaf.endswith("scale") else 0.0)
    if name.endswith(("attn_sink", "gate.bias")):
        return normal(0.5)
    if name.endswith("ape"):
        return normal(0.3)
    if name.endswith("norm.weight"):
        return normal(0.1, 1.0)
    if name == "embed.weight":
        return normal(1.0)
    return normal(shape[-1] ** -0.5)   # projections and experts: unit-variance outputs


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter and persistent buffer from `seed`, in name order (device-independent names)."""
    cfg, quant = model.cfg, model.cfg.quant
    device = model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = checkpoint_tensors(model)
    for name in sorted(tensors):
        t = tensors[name]
        value = _sample(name, t.shape, cfg, gen, device)
        if not t.dtype.is_floating_point:
            t.copy_(value)
            continue
        if quant is not None and is_fp8_weight(name):
            value = dequantize_fp8_blocks(*quantize_fp8_blocks(value, quant.weight_block_size, quant.scale_fmt),
                                          quant.weight_block_size, torch.float32)
        elif quant is not None and ".ffn.experts.w" in name:
            if quant.expert_dtype == "fp4":
                value = dequantize_fp4(*quantize_fp4(value), 32, torch.float32)
            else:
                blocks = quant.weight_block_size
                value = torch.stack([dequantize_fp8_blocks(*quantize_fp8_blocks(v, blocks, quant.scale_fmt), blocks,
                                                           torch.float32) for v in value])
        elif not is_fp32_tensor(name):
            value = value.to(torch.bfloat16)
        t.copy_(value.to(t.dtype))
