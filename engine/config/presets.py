"""Named model presets for make-checkpoint and tests: `tiny` (CPU seconds) and `flash` (released dims)."""

from __future__ import annotations

import dataclasses

from ..errors import ConfigError
from .deepseek_v4 import CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config, WeightQuant, YarnScaling, validate
from .deepseek_v41 import DeepseekV41Config, default_dspark_targets, engram_table_rows
from .deepseek_v41 import validate as validate_v41

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

V41_QUANT = WeightQuant(weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4")

# The released DeepSeek-V4.1-Flash text model (design doc section 0); every other value is the dataclass default.
FLASH_V41 = DeepseekV41Config(
    compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20,
    kv_source_layer_ids=(2, 8, 14, 20),
    index_source_layer_ids=(2, 8, 14, 20, 24, 28, 32, 36),
    candidate_source_layer_id=20, candidate_topk_blocks=2048, candidate_block_size=8,
    engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
    dspark_target_layer_ids=(37, 38, 39),
    rope_scaling=YarnScaling(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0),
    rms_norm_eps=1e-20, quant=V41_QUANT, has_vision=False,
)

# CPU seconds, with every layer kind of the release, in release order:
#   0 sliding | 1 sliding + engram | 2 ratio-2 KV source | 3 ratio-2 reuse | 4 second ratio-2 KV source + engram
#   (the per-group reset) | 5 its reuse | 6 ratio-1 KV source = candidate source | 7 ratio-1 reuse
#   | 8 reindex source (index source, no KV) | 9 reuse after the reindex; DSpark reads 7, 8, 9.
# head_dim 96 and rope 32 are multiples of 16 and 32 (the FP4/FP8 QAT blocks); the indexer's 32 heads x 32 dims
# keep ReLU score ties out of top-k and fit the FP4 block of 32. 2 candidate blocks of 4 = 8 >= index_topk 6.
# engram_num_embeddings = engram_table_rows(50, 2, 4, 2), computed once with sympy.nextprime:
#   layer 1 primes [[53, 59], [61, 67], [71, 73]] -> 384; layer 4 [[79, 83], [89, 97], [101, 103]] -> 552.
# Token ids: 2 engram pad, 3 DSpark noise, 4 image (specials the tiny tokenizer leaves unused).
TINY_V41 = DeepseekV41Config(
    vocab_size=512, hidden_size=64, num_hidden_layers=10, num_attention_heads=4, head_dim=96, qk_rope_head_dim=32,
    q_lora_rank=48, o_groups=2, o_lora_rank=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=64, sliding_window=8,
    compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(2, 4, 6),
    index_source_layer_ids=(2, 4, 6, 8), candidate_source_layer_id=6, candidate_topk_blocks=2,
    candidate_block_size=4, index_n_heads=32, index_head_dim=32, index_topk=6,
    engram_layer_ids=(1, 4), engram_vocab_size=50, engram_num_embeddings=(384, 552), engram_max_ngram_size=4,
    engram_n_heads=2, engram_head_dim=32, engram_pad_id=2,
    # Placeholder: the checkpoint maker overwrites it with the value the tiny tokenizer's compressed map yields.
    engram_compressed_vocab_size=512,
    num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=3, dspark_target_layer_ids=(7, 8, 9),
    dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
    max_position_embeddings=4096, image_token_id=4,
    rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0),
    quant=V41_QUANT,
)

PRESETS = {("deepseek_v4", "tiny"): TINY_V4, ("deepseek_v4", "flash"): FLASH_V4,
           ("deepseek_v41", "tiny"): TINY_V41, ("deepseek_v41", "flash"): FLASH_V41}


def preset_config(arch: str, preset: str, layers: int | None = None, engram_vocab_size: int | None = None):
    """A preset, optionally cut to `layers` layers and (V4.1) with smaller Engram tables (`engram_vocab_size`)."""
    if (arch, preset) not in PRESETS:
        known = sorted(f"{a}/{p}" for a, p in PRESETS)
        raise ConfigError(f"no preset {preset!r} for arch {arch!r}; known: {known}")
    cfg = PRESETS[(arch, preset)]
    if layers is not None and not 1 <= layers <= cfg.num_hidden_layers:
        raise ConfigError(f"--layers {layers} is outside 1..{cfg.num_hidden_layers} for {arch}/{preset}")
    if isinstance(cfg, DeepseekV4Config):
        if engram_vocab_size is not None:
            raise ConfigError(f"{arch} has no Engram tables; engram_vocab_size applies to deepseek_v41 only")
        if layers is not None:
            cfg = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers],
                                      mlp_layer_types=cfg.mlp_layer_types[:layers])
        validate(cfg)
        return cfg
    if layers is not None and layers != cfg.num_hidden_layers:
        cfg = reduce_v41_layers(cfg, layers)
    if engram_vocab_size is not None:
        cfg = dataclasses.replace(cfg, engram_vocab_size=engram_vocab_size)
        cfg = dataclasses.replace(cfg, engram_num_embeddings=_engram_rows(cfg))
    validate_v41(cfg)
    return cfg


def _engram_rows(cfg: DeepseekV41Config) -> tuple[int, ...]:
    return engram_table_rows(cfg.engram_vocab_size, len(cfg.engram_layer_ids), cfg.engram_max_ngram_size,
                             cfg.engram_n_heads)


def v41_layer_priority(cfg: DeepseekV41Config) -> list[int]:
    """The order in which `reduce_v41_layers` keeps layers; every prefix holds the KV and index source each kept
    layer reads. Seeds, in order: first sliding layer, first KV source, candidate source, first reindex source,
    first engram layer, the layer after each of the first KV source / candidate / first reindex (their reuse),
    each later engram layer and the layer after it; then every remaining layer in ascending order."""
    n = cfg.num_hidden_layers
    sliding = [i for i in range(n) if cfg.compress_ratios[i] == 0]
    reindex = [i for i in cfg.index_source_layer_ids if i not in cfg.kv_source_layer_ids]
    firsts = [sliding[:1], cfg.kv_source_layer_ids[:1], [cfg.candidate_source_layer_id], reindex[:1],
              cfg.engram_layer_ids[:1]]
    seeds = [i for group in firsts for i in group]
    seeds += [i + 1 for group in firsts[1:4] for i in group]
    seeds += [i + d for i in cfg.engram_layer_ids[1:] for d in (0, 1)]
    order: list[int] = []
    for layer in seeds + list(range(n)):
        if 0 <= layer < n:
            for need in _reads(cfg, layer) + [layer]:
                if need not in order:
                    order.append(need)
    return order


def _reads(cfg: DeepseekV41Config, layer: int) -> list[int]:
    """The KV source and the index source (and that one's KV source) whose products `layer` reads."""
    if cfg.compress_ratios[layer] == 0:
        return []
    index = [s for s in cfg.index_source_layer_ids if s <= layer][-1:]
    return [s for s in [cfg.kv_source_of(index[0]) if index else None, *index, cfg.kv_source_of(layer)]
            if s is not None]


def reduce_v41_layers(cfg: DeepseekV41Config, layers: int) -> DeepseekV41Config:
    """The config restricted to the first `layers` layers of `v41_layer_priority`, renumbered in their original
    order: kept layers keep their ratio and roles; DSpark targets follow transformers' default rule; Engram rows
    are recomputed for the kept Engram layers."""
    keep = sorted(v41_layer_priority(cfg)[:layers])
    new = {old: i for i, old in enumerate(keep)}
    remap = lambda ids: tuple(new[i] for i in ids if i in new)  # noqa: E731
    kv = remap(cfg.kv_source_layer_ids)
    cfg = dataclasses.replace(
        cfg, num_hidden_layers=layers, compress_ratios=tuple(cfg.compress_ratios[i] for i in keep),
        kv_source_layer_ids=kv, index_source_layer_ids=remap(cfg.index_source_layer_ids),
        candidate_source_layer_id=new.get(cfg.candidate_source_layer_id, -1),
        engram_layer_ids=remap(cfg.engram_layer_ids), dspark_target_layer_ids=default_dspark_targets(layers, kv))
    return dataclasses.replace(cfg, engram_num_embeddings=_engram_rows(cfg))
