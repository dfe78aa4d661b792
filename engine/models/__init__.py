"""Model families by HF model_type, and construction straight onto a device."""

from __future__ import annotations

import torch

from .deepseek_v4 import DeepseekV4ForCausalLM
from .deepseek_v41 import DeepseekV41ForCausalLM
from .rope import RotaryEmbedding

MODEL_CLASSES = {"deepseek_v4": DeepseekV4ForCausalLM, "deepseek_v41": DeepseekV41ForCausalLM}


def build_model(cfg, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                qat_fake_quant: bool = True, **options) -> torch.nn.Module:
    """Allocate the model on `device` without initializing it (weights come from a checkpoint or
    init_random_weights); built on the meta device first so nothing is materialized twice."""
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model_type](cfg, dtype=dtype, qat_fake_quant=qat_fake_quant, **options)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
    return model.eval()


__all__ = ["MODEL_CLASSES", "build_model", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"]
