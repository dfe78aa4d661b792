"""deepinfer.load_model: checkpoint directory or hub id -> a model on the requested device."""

from __future__ import annotations

import os

import torch

from .checkpoint.hub import resolve_model_dir
from .checkpoint.loader import load_checkpoint
from .config import load_model_config
from .errors import DeepInferError
from .models import build_model

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DeepInferError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_model(path_or_id: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = torch.float32, qat_fake_quant: bool = True,
               keep_quantized: bool = False) -> torch.nn.Module:
    """Load a deepseek_v4 checkpoint (DeepSeek or transformers names, bf16/FP8/FP4) for inference.

    qat_fake_quant keeps DeepSeek's quantization-aware activation steps (FP8 K=V latent, FP4 indexer);
    turn it off to compare with transformers, which leaves them out. keep_quantized keeps the on-disk
    FP8/FP4 tensors attached to their modules (`.quantized`) beside the dequantized weights.
    """
    ckpt_dir = resolve_model_dir(path_or_id)
    cfg = load_model_config(ckpt_dir)
    model = build_model(cfg, device, parse_dtype(dtype), qat_fake_quant)
    load_checkpoint(model, ckpt_dir, keep_quantized=keep_quantized)
    model.checkpoint_dir = ckpt_dir
    return model
