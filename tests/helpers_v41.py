"""Shared V4.1 test builders: the tiny config bound to its tokenizer, our model with random weights."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch

from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.checkpoint.tokenizer import train_tokenizer
from deepinfer.config.deepseek_v4 import YarnScaling
from deepinfer.config.deepseek_v41 import DeepseekV41Config
from deepinfer.models import build_model
from deepinfer.models.engram import compressed_token_map, engram_num_embeddings

BASE = DeepseekV41Config(
    vocab_size=512, hidden_size=64, num_hidden_layers=10, num_attention_heads=4, head_dim=96,
    qk_rope_head_dim=32, q_lora_rank=48, o_groups=2, o_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, sliding_window=8, compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1),
    kv_source_layer_ids=(2, 4, 6), index_source_layer_ids=(2, 4, 6, 8), candidate_source_layer_id=6,
    candidate_topk_blocks=2, candidate_block_size=4, index_n_heads=32, index_head_dim=32, index_topk=6,
    engram_layer_ids=(1, 4), engram_vocab_size=50, engram_n_heads=2, engram_head_dim=32,
    num_nextn_predict_layers=0, dspark_target_layer_ids=(7, 8, 9), dspark_noise_token_id=5,
    rope_scaling=YarnScaling(factor=4, original_max_position_embeddings=256), max_position_embeddings=4096)


@lru_cache(maxsize=1)
def tiny_v41_tokenizer():
    return train_tokenizer(BASE.vocab_size)


@lru_cache(maxsize=1)
def tiny_v41_config() -> DeepseekV41Config:
    _, size = compressed_token_map(tiny_v41_tokenizer())
    cfg = dataclasses.replace(BASE, engram_compressed_vocab_size=size)
    return dataclasses.replace(cfg, engram_num_embeddings=tuple(engram_num_embeddings(cfg)))


def tiny_v41_model(dtype=torch.float32, qat: bool = True, seed: int = 0, cfg: DeepseekV41Config | None = None,
                   device: str = "cpu"):
    model = build_model(cfg or tiny_v41_config(), device, dtype, qat_fake_quant=qat)
    init_random_weights(model, seed)
    model.bind_tokenizer(tiny_v41_tokenizer())
    return model
