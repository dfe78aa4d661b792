"""Shared V4.1 test builders: the tiny preset bound to its tokenizer, our model with random weights."""

from __future__ import annotations

from functools import lru_cache

import torch

from deepinfer.checkpoint.make import bind_config_to_tokenizer
from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.checkpoint.tokenizer import train_tokenizer
from deepinfer.config.deepseek_v41 import DeepseekV41Config
from deepinfer.config.presets import preset_config
from deepinfer.models import build_model


@lru_cache(maxsize=1)
def tiny_v41_tokenizer():
    return train_tokenizer(preset_config("deepseek_v41", "tiny").vocab_size)


@lru_cache(maxsize=1)
def tiny_v41_config() -> DeepseekV41Config:
    """TINY_V41 with the compressed vocabulary of its tokenizer (as make-checkpoint writes it)."""
    return bind_config_to_tokenizer(preset_config("deepseek_v41", "tiny"), tiny_v41_tokenizer())


def tiny_v41_model(dtype=torch.float32, qat: bool = True, seed: int = 0, cfg: DeepseekV41Config | None = None,
                   device: str = "cpu"):
    model = build_model(cfg or tiny_v41_config(), device, dtype, qat_fake_quant=qat)
    init_random_weights(model, seed)
    model.bind_tokenizer(tiny_v41_tokenizer())
    return model
