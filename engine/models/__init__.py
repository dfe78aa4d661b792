"""Model families by HF model_type, and construction straight onto a device. Every family keeps the contract of
base.py (CausalLM)."""

from __future__ import annotations

import torch

from deepinfer.kernels.fp8_linear import BLOCKS as FP8_BLOCKS

from ..errors import DeepInferError
from .base import CausalLM, Drafting
from .common.layers import PROJECTION_STORAGE, Fp8Linear, fp8_projections
from .common.rope import RotaryEmbedding
from .deepseek_v4 import DeepseekV4ForCausalLM
from .deepseek_v41 import DeepseekV41ForCausalLM

MODEL_CLASSES = {"deepseek_v4": DeepseekV4ForCausalLM, "deepseek_v41": DeepseekV41ForCausalLM}


def build_model(cfg, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                qat_fake_quant: bool = True, projection_storage: str = "dense", prepare=None,
                **options) -> torch.nn.Module:
    """Allocate the model on `device` without initializing it (weights come from a checkpoint or
    init_random_weights); built on the meta device first so nothing is materialized twice.
    projection_storage="fp8": the projections the release stores as FP8 blocks stay FP8 (layers.Fp8Linear,
    DeepSeek's W8A8 recipe; wo_a excepted, as DeepSeek's reference runs it); "dense" (default): every weight in
    the compute dtype, as transformers runs them. prepare(model), when given, runs on the unmaterialized model: what
    it shrinks or moves (an expert-parallel rank's expert slots, host-resident engram tables) is never allocated on
    `device`."""
    check_projection_storage(projection_storage, cfg)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model_type](cfg, dtype=dtype, qat_fake_quant=qat_fake_quant, **options)
        if projection_storage == "fp8":
            from ..checkpoint.random_init import is_fp8_weight
            # wo_a stays dense: DeepSeek's convert.py dequantizes it, its grouped einsum runs in BF16
            fp8_projections(model, lambda name: is_fp8_weight(name, cfg.model_type), cfg.quant.weight_block_size[0],
                            keep_dense=("attn.wo_a",))
    if prepare is not None:        # outside the meta context: what it computes (placements) holds real values
        prepare(model)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return model.eval()


def check_projection_storage(projection_storage, cfg=None) -> str:
    """'dense' or 'fp8' (with a config: 'fp8' needs the release's FP8 projections in square blocks of 32 or
    128)."""
    if projection_storage not in PROJECTION_STORAGE:
        raise DeepInferError(f"projection_storage={projection_storage!r} is not supported; use 'dense' or 'fp8'")
    if projection_storage == "fp8" and cfg is not None:
        quant = cfg.quant
        if quant is None:
            raise DeepInferError("projection_storage='fp8' keeps the release's FP8 projections, but this config "
                                 "declares none (no quantization_config); use projection_storage='dense'")
        b = tuple(quant.weight_block_size)
        if b[0] != b[1] or b[0] not in FP8_BLOCKS:
            raise DeepInferError(f"projection_storage='fp8' runs square weight blocks of 32 (V4.1) or 128 (V4); "
                                 f"this config has weight_block_size={list(b)}: use projection_storage='dense'")
    return projection_storage


def projection_storage_of(model: torch.nn.Module) -> str:
    """How a built model holds its FP8-in-the-release projections."""
    return "fp8" if any(isinstance(m, Fp8Linear) for m in model.modules()) else "dense"


__all__ = ["MODEL_CLASSES", "PROJECTION_STORAGE", "CausalLM", "Drafting", "build_model", "check_projection_storage",
           "projection_storage_of", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"]
