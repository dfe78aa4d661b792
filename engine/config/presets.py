"""Named model presets for make-checkpoint and tests: `tiny` (CPU seconds) and `flash` (released dims)."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from .deepseek_v4 import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config, WeightQuant, YarnScaling, validate

FLASH_V4 = DeepseekV4Config(
    layer_types=tuple([SLIDING] * 2 + [CSA, HCA] * 20 + [CSA]),
    mlp_layer_types=tuple([HASH_MOE] * 3 + [MOE] * 40),
    rope_scaling=YarnScaling(factor=16, original_max_position_embeddings=65536),
    quant=WeightQuant(),
)

# Small enough for CPU CI, with every layer kind (sliding, CSA, HCA; hash and scored MoE) and
# window/compression sizes that sequences of a few hundred tokens cross many times over.
# 32 indexer heads keep exact-zero ReLU score ties (which top-k breaks arbitrarily) out of the tests.
# head_dim - rope_dim = 64 so the K=V latent's FP8 QAT blocks (64 channels) divide it as in the release.
TINY_V4 = DeepseekV4Config(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=96,
    qk_rope_head_dim=32, q_lora_rank=48, o_groups=2, o_lora_rank=32, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=16,
    layer_types=(SLIDING, CSA, HCA, CSA), compress_rates=((CSA, 4), (HCA, 16)),
    mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE), index_n_heads=32, index_head_dim=64, index_topk=8,
    rope_scaling=YarnScaling(factor=4, original_max_position_embeddings=256),
    max_position_embeddings=1024, quant=WeightQuant(),
)

PRESETS = {("deepseek_v4", "tiny"): TINY_V4, ("deepseek_v4", "flash"): FLASH_V4}


def preset_config(arch: str, preset: str, layers: int | None = None) -> DeepseekV4Config:
    if (arch, preset) not in PRESETS:
        known = sorted(f"{a}/{p}" for a, p in PRESETS)
        raise ConfigError(f"no preset {preset!r} for arch {arch!r}; known: {known}")
    cfg = PRESETS[(arch, preset)]
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise ConfigError(f"--layers {layers} is outside 1..{cfg.num_hidden_layers} for {arch}/{preset}")
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers],
                                  mlp_layer_types=cfg.mlp_layer_types[:layers])
    validate(cfg)
    return cfg
