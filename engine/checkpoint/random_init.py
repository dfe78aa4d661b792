"""Seeded random weights that look like the release's: quantized weights hold exactly what their
FP8/FP4 export dequantizes to, bf16 tensors hold bf16-representable values, fp32 ones stay fp32.

Which tensors are FP8 / F32 on disk differs per model family (design docs: V4 section 5, V4.1 section 7);
the lists below are the one place that says so, shared with the writer."""

from __future__ import annotations

import math

import torch

from deepinfer.kernels.quant import (dequantize_fp4, dequantize_fp8_blocks, quantize_fp4, quantize_fp8_blocks,
                                     scale_to_float)

from .names import checkpoint_tensors

# Dense weights stored as FP8 blocks in the release (everything else floating stays BF16 or F32), per family.
FP8_WEIGHTS = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
               "attn.indexer.wq_b.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
               "shared_experts.w3.weight", "e_proj.weight", "h_proj.weight")
# V4.1 (design doc section 7): the attention's own wkv (never attn.compressor.wkv, which is BF16), the engram's
# key/value projection and DSpark's main_proj; no MTP e_proj/h_proj. Engram tables are FP8 rows (ENGRAM_TABLE).
FP8_WEIGHTS_V41 = tuple(w for w in FP8_WEIGHTS if not w.startswith(("e_proj", "h_proj"))) + (
    "engram.wkv.weight", "main_proj.weight")
# Tensors kept in F32 in the release.
FP32_SUFFIXES = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                 "hc_head_fn", "hc_head_base", "hc_head_scale", "attn_sink", "ape", "gate.bias")
FP32_SUFFIXES_V41 = tuple(s for s in FP32_SUFFIXES if not s.startswith(("hc_head", "ape"))) + ("gate.bias_vl",)
_FP8 = {"deepseek_v4": FP8_WEIGHTS, "deepseek_v41": FP8_WEIGHTS_V41}
_FP32 = {"deepseek_v4": FP32_SUFFIXES, "deepseek_v41": FP32_SUFFIXES_V41}
# V4.1 engram hash tables: FP8 e4m3 rows with one e8m0 scale per 32 channels (`engram.embed.scale`).
ENGRAM_TABLE = "engram.embed.weight"
ENGRAM_ROW_BLOCK = (1, 32)


def is_fp8_weight(name: str, model_type: str = "deepseek_v4") -> bool:
    return name.endswith(_FP8[model_type])


def is_fp32_tensor(name: str, model_type: str = "deepseek_v4") -> bool:
    return name.endswith(_FP32[model_type])


def is_engram_table(name: str) -> bool:
    return name.endswith(ENGRAM_TABLE)


def _sample(name: str, shape: torch.Size, cfg, gen: torch.Generator, device) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        # in place: a flash-width expert stack is 8.6 GB in fp32, and each out-of-place step would add one more
        return torch.randn(shape, generator=gen, device=device).mul_(std).add_(mean)

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("tid2eid"):  # distinct experts per token
        keys = torch.rand(shape[0], cfg.n_routed_experts, generator=gen, device=device)
        return keys.argsort(dim=-1)[:, : shape[1]].to(torch.long)
    if name.endswith("_fn"):
        return normal(0.5 * shape[-1] ** -0.5)
    if name.endswith(("_base", "_scale")) and "hc_" in name:
        return normal(0.3, 1.0 if leaf.endswith("scale") else 0.0)
    if name.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
        return normal(0.5)
    if name.endswith("ape"):
        return normal(0.3)
    if name.endswith(("norm.weight", "engram.q_weight", "engram.k_weight")):
        return normal(0.1, 1.0)
    if name.endswith(ENGRAM_TABLE):
        # Unit-variance rows: wkv (std in^-0.5) then gives unit-variance keys and values, the size of the
        # embeddings. The gate normalizes stream and key (RMS), so its pre-activation is ~N(0, 1) for q*k
        # weights near 1 whatever the row scale: gates spread over about 0.2..0.8, not saturated.
        return normal(1.0)
    if ".markov_head." in name:
        # Markov bias = head_m . embed_m[prev] over rank r: std 0.3 r^-1/4 each gives a bias of std ~0.09.
        return normal(0.3 * shape[-1] ** -0.25)
    if ".confidence_head." in name:
        return normal(0.1 * shape[-1] ** -0.5)   # a raw confidence logit of std ~0.1
    if name == "embed.weight":
        return normal(1.0)
    return normal(shape[-1] ** -0.5)   # projections and experts: unit-variance outputs


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter and persistent buffer from `seed`, in name order (device-independent names)."""
    cfg, quant = model.cfg, model.cfg.quant
    family = cfg.model_type
    device = model.device
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = checkpoint_tensors(model)
    for name in sorted(tensors):
        t = tensors[name]
        if _is_resident_fp4(name):
            _sample_resident_fp4(name, t, gen)
            continue
        if _is_fp8_resident_scale(name, tensors):
            continue           # filled with its weight, below: the weights' draws are the dense model's
        value = _sample(name, t.shape, cfg, gen, device)
        if t.dtype == torch.float8_e4m3fn:       # projection_storage="fp8": the bytes the release would hold
            w, scale = quantize_fp8_blocks(value, quant.weight_block_size, quant.scale_fmt)
            t.copy_(w)
            tensors[name[: -len("weight")] + "scale"].copy_(scale_to_float(scale))
            continue
        if not t.dtype.is_floating_point:
            t.copy_(value)
            continue
        if quant is not None and is_fp8_weight(name, family):
            value = dequantize_fp8_blocks(*quantize_fp8_blocks(value, quant.weight_block_size, quant.scale_fmt),
                                          quant.weight_block_size, torch.float32)
        elif quant is not None and family == "deepseek_v41" and is_engram_table(name):
            value = dequantize_fp8_blocks(*quantize_fp8_blocks(value, ENGRAM_ROW_BLOCK, quant.scale_fmt),
                                          ENGRAM_ROW_BLOCK, torch.float32)
        elif quant is not None and ".ffn.experts.w" in name:
            for v in value:      # expert by expert, in place: the quantizers' temporaries are several stacks' size
                if quant.expert_dtype == "fp4":
                    v.copy_(dequantize_fp4(*quantize_fp4(v), 32, torch.float32))
                else:
                    blocks = quant.weight_block_size
                    v.copy_(dequantize_fp8_blocks(*quantize_fp8_blocks(v, blocks, quant.scale_fmt), blocks,
                                                  torch.float32))
        elif not is_fp32_tensor(name, family):
            value = value.to(torch.bfloat16)
        t.copy_(value)             # casts as .to(t.dtype) would, without a second copy of the stack


def _is_fp8_resident_scale(name: str, tensors: dict) -> bool:
    """An FP8-resident projection's `.scale` (projection_storage="fp8"): its weight is float8_e4m3fn."""
    weight = tensors.get(name[: -len("scale")] + "weight") if name.endswith(".scale") else None
    return weight is not None and weight.dtype == torch.float8_e4m3fn


def _is_resident_fp4(name: str) -> bool:
    """Routed experts kept FP4-packed in the model (expert_storage="fp4"): `ffn.experts.w*_fp4` / `w*_scale`."""
    return ".ffn.experts.w" in name and name.endswith(("_fp4", "_scale"))


def _sample_resident_fp4(name: str, t: torch.Tensor, gen: torch.Generator) -> None:
    """Packed e2m1 bytes uniform over all 16 codes (std ~2.9 per element) and one e8m0 scale per 32 along
    K chosen for unit-variance outputs, scale ~ fan_in^-1/2 / 2.9. (Not the values the dense path draws:
    drawing a full [E, I, D] float tensor first is what this storage exists to avoid.)"""
    if name.endswith("_fp4"):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, device=t.device, dtype=torch.uint8))
    else:
        fan_in = t.shape[-1] * 32
        t.fill_(127 + round(-0.5 * math.log2(fan_in) - 1.5))
