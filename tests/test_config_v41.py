"""DeepSeek-V4.1 config.json parsing: composite and bare, transformers' and DeepSeek's spellings agree, absent
schedule keys are derived as transformers derives them, presets and their --layers reductions keep every layer
kind, and inconsistent configs fail with one clear ConfigError line."""

from __future__ import annotations

import copy
import dataclasses
import json
import time

import pytest

from deepinfer.config import load_model_config, parse_model_config
from deepinfer.config.deepseek_v41 import (INDEX_SOURCE, KV_SOURCE, REUSE, SLIDING_ONLY, DeepseekV41Config,
                                           engram_prime_layout, engram_table_rows, parse_deepseek_v41)
from deepinfer.config.deepseek_v4 import WeightQuant, YarnScaling
from deepinfer.config.presets import FLASH_V41, TINY_V41, preset_config, v41_layer_priority
from deepinfer.errors import ConfigError
from tests.helpers import config_error

PRESETS = {"tiny": TINY_V41, "flash": FLASH_V41}
RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]

# The released config.json's text model, as published (composite; bos/eos/quantization at the top level).
RELEASED_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
    "transformers_version": "5.6.0", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "tie_word_embeddings": False,
        "max_position_embeddings": 1048576, "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": RELEASED_RATIOS, "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    },
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024},
}

# The released inference/config.json (DeepSeek's ModelArgs spelling; no model_type, no scale_fmt).
RELEASED_INFERENCE = {
    "vocab_size": 129280, "dim": 5120, "moe_inter_dim": 2304, "n_layers": 40, "n_mtp_layers": 3,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_n_activated_experts": 3, "n_heads": 64,
    "n_routed_experts": 384, "n_shared_experts": 1, "n_activated_experts": 6, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1280, "head_dim": 512, "rope_head_dim": 64,
    "norm_eps": 1e-20, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128, "kv_source_layers": [2, 8, 14, 20],
    "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36], "original_seq_len": 65536, "rope_theta": 10000,
    "rope_factor": 16, "beta_fast": 32, "beta_slow": 1, "index_n_heads": 32, "index_head_dim": 128,
    "index_topk": 512, "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "engram_layer_ids": [1, 14],
    "engram_vocab_size": 16000000, "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "dtype": "fp8", "expert_dtype": "fp4",
    "compress_rope_theta": 160000, "compress_ratios": RELEASED_RATIOS, "vision_n_layers": 32, "vision_dim": 1024,
    "vision_n_heads": 16, "vision_max_wh_ratio": None, "image_token_id": 129264, "engram_n_heads": 8,
    "engram_head_dim": 256, "vision_rope_theta": 10000,
}


def inference_args(cfg: DeepseekV41Config) -> dict:
    """DeepSeek's ModelArgs spelling, written key by key by hand (not by our writers)."""
    y = cfg.rope_scaling
    return {
        "model_type": "deepseek_v41", "vocab_size": cfg.vocab_size, "dim": cfg.hidden_size,
        "n_layers": cfg.num_hidden_layers, "n_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
        "rope_head_dim": cfg.qk_rope_head_dim, "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups,
        "o_lora_rank": cfg.o_lora_rank, "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts, "n_activated_experts": cfg.num_experts_per_tok,
        "moe_inter_dim": cfg.moe_intermediate_size, "score_func": cfg.scoring_func,
        "route_scale": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit, "window_size": cfg.sliding_window,
        "compress_ratios": list(cfg.compress_ratios) + [0] * cfg.num_nextn_predict_layers,
        "kv_source_layers": list(cfg.kv_source_layer_ids), "index_source_layers": list(cfg.index_source_layer_ids),
        "candidate_source_layer": cfg.candidate_source_layer_id, "candidate_topk_blocks": cfg.candidate_topk_blocks,
        "candidate_block_size": cfg.candidate_block_size, "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk, "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta, "rope_factor": y.factor,
        "original_seq_len": y.original_max_position_embeddings, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
        "engram_layer_ids": list(cfg.engram_layer_ids), "engram_vocab_size": cfg.engram_vocab_size,
        "engram_num_embeddings": list(cfg.engram_num_embeddings), "engram_max_ngram_size": cfg.engram_max_ngram_size,
        "engram_n_heads": cfg.engram_n_heads, "engram_head_dim": cfg.engram_head_dim, "engram_pad_id": cfg.engram_pad_id,
        "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size, "n_mtp_layers": cfg.num_nextn_predict_layers,
        "dspark_block_size": cfg.dspark_block_size, "dspark_noise_token_id": cfg.dspark_noise_token_id,
        "dspark_target_layer_ids": list(cfg.dspark_target_layer_ids), "dspark_markov_rank": cfg.dspark_markov_rank,
        "dspark_n_routed_experts": cfg.dspark_n_routed_experts,
        "dspark_n_activated_experts": cfg.dspark_num_experts_per_tok, "image_token_id": cfg.image_token_id,
        "max_position_embeddings": cfg.max_position_embeddings, "max_seq_len": 4096, "max_batch_size": 4,
        "dtype": "fp8", "expert_dtype": cfg.quant.expert_dtype,
    }


def _hf(cfg=TINY_V41, **text_changes) -> dict:
    d = cfg.to_hf_dict()
    d["text_config"].update(text_changes)
    return d


def _ds(cfg=TINY_V41, **text_changes) -> dict:
    d = cfg.to_deepseek_dict()
    d["text_config"].update(text_changes)
    return d


def _bare(cfg=TINY_V41, **changes) -> dict:
    """A bare deepseek_v41_text config: the text keys plus the top-level ones, all at the top level."""
    d = cfg.to_hf_dict()
    text = d.pop("text_config")
    return text | {k: v for k, v in d.items() if k not in ("model_type", "architectures")} | changes


def _plain(**changes) -> dict:
    """A bare config without the keys transformers derives (layer_types, rope_parameters), so one change stays one."""
    d = _bare()
    del d["layer_types"], d["rope_parameters"]
    return d | changes


# ----------------------------------------------------------------------------- spellings and round trips

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_all_spellings_parse_to_the_preset(preset):
    cfg = PRESETS[preset]
    parsed = [parse_model_config(json.loads(json.dumps(d)))
              for d in (cfg.to_hf_dict(), cfg.to_deepseek_dict(), inference_args(cfg), _bare(cfg))]
    assert all(p == cfg for p in parsed)
    assert len({p.config_hash() for p in parsed}) == 1


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("variant", ["as is", "vision, no quant, no yarn"])
def test_writers_round_trip(preset, variant):
    cfg = PRESETS[preset]
    if variant != "as is":
        cfg = dataclasses.replace(cfg, has_vision=True, quant=None, rope_scaling=None)
    for write in (DeepseekV41Config.to_hf_dict, DeepseekV41Config.to_deepseek_dict):
        again = parse_deepseek_v41(write(cfg))
        assert again == cfg and write(again) == write(cfg)


def test_the_released_config_files_are_the_flash_preset():
    assert parse_model_config(copy.deepcopy(RELEASED_CONFIG)) == dataclasses.replace(FLASH_V41, has_vision=True)
    assert parse_deepseek_v41(copy.deepcopy(RELEASED_INFERENCE)) == dataclasses.replace(FLASH_V41, has_vision=True)
    no_vision = {k: v for k, v in RELEASED_CONFIG.items() if k != "vision_config"}
    assert parse_model_config(no_vision) == FLASH_V41


def test_writer_spellings():
    hf, ds = FLASH_V41.to_hf_dict(), FLASH_V41.to_deepseek_dict()
    for d in (hf, ds):
        assert d["model_type"] == "deepseek_v41" and d["architectures"] == ["DeepseekV41ForCausalLM"]
        assert d["text_config"]["model_type"] == "deepseek_v41_text"
        assert d["text_config"]["compress_ratios"] == RELEASED_RATIOS
        assert d["quantization_config"] == RELEASED_CONFIG["quantization_config"]
        assert d["image_token_id"] == 129264
    assert hf["text_config"]["engram_pad_id"] == 2 and "engram_pad_token_id" not in hf["text_config"]
    assert ds["text_config"]["engram_pad_token_id"] == 2 and "engram_pad_id" not in ds["text_config"]
    assert ds["text_config"]["rope_scaling"] == {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                                 "original_max_position_embeddings": 65536}
    assert hf["text_config"]["rope_parameters"] == {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "partial_rotary_factor": 0.125, "factor": 16.0,
                     "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 65536,
                     "attention_factor": 1.0}}
    assert hf["text_config"]["layer_types"] == ["shared_compressed_attention" if i in (2, 8, 14, 20)
                                                else "sliding_attention" for i in range(40)]
    assert (ds["bos_token_id"], ds["eos_token_id"]) == (0, 1)


def test_composite_and_bare_text_configs_agree():
    assert parse_model_config(_bare()) == TINY_V41
    assert parse_model_config(_bare(model_type="deepseek_v41")) == TINY_V41   # flat composite, as transformers
    # quantization_config may sit in text_config, at the top level, or both when they agree
    d = TINY_V41.to_hf_dict()
    d["text_config"]["quantization_config"] = d.pop("quantization_config")
    assert parse_model_config(d) == TINY_V41
    d["quantization_config"] = d["text_config"]["quantization_config"]
    assert parse_model_config(d) == TINY_V41


def test_load_model_config_reads_a_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_CONFIG))
    assert load_model_config(tmp_path) == dataclasses.replace(FLASH_V41, has_vision=True)


@pytest.mark.parametrize("deepseek, hf, value", [
    ("dim", "hidden_size", 64), ("n_layers", "num_hidden_layers", 10), ("n_heads", "num_attention_heads", 4),
    ("rope_head_dim", "qk_rope_head_dim", 32), ("window_size", "sliding_window", 8), ("norm_eps", "rms_norm_eps", 1e-20),
    ("n_mtp_layers", "num_nextn_predict_layers", 3), ("moe_inter_dim", "moe_intermediate_size", 64),
    ("n_activated_experts", "num_experts_per_tok", 2), ("score_func", "scoring_func", "sqrtsoftplus"),
    ("route_scale", "routed_scaling_factor", 1.5), ("engram_pad_token_id", "engram_pad_id", 2),
    ("engram_pad_id", "engram_pad_id", 2), ("kv_source_layers", "kv_source_layer_ids", [2, 4, 6]),
    ("index_source_layers", "index_source_layer_ids", [2, 4, 6, 8]),
    ("candidate_source_layer", "candidate_source_layer_id", 6),
    ("dspark_n_activated_experts", "dspark_num_experts_per_tok", 2), ("num_local_experts", "n_routed_experts", 8),
])
def test_deepseek_and_hf_aliases_are_equivalent(deepseek, hf, value):
    d = _bare()
    d.pop(hf)
    assert parse_model_config(d | {deepseek: value}) == TINY_V41
    assert parse_model_config(d | {deepseek: value, hf: value}) == TINY_V41
    if deepseek != hf:
        other = 7 if not isinstance(value, (list, str)) else ["x"]
        config_error(d | {deepseek: value, hf: other}, deepseek, hf, "keep one")


def test_rope_spellings_are_equivalent():
    text = _bare()
    text.pop("rope_parameters")
    assert parse_model_config(text) == TINY_V41                                     # rope_scaling alone
    text.pop("rope_scaling")
    flat = text | {"rope_factor": 4, "original_seq_len": 256, "beta_fast": 32, "beta_slow": 1}
    assert parse_model_config(flat) == TINY_V41                                     # ModelArgs keys
    plain = dataclasses.replace(TINY_V41, rope_scaling=None)
    assert parse_model_config(text) == plain
    assert parse_model_config(flat | {"original_seq_len": 0}) == plain              # ModelArgs: no YaRN at 0
    assert parse_model_config(text | {"rope_scaling": {"rope_type": "default"}}) == plain
    params = TINY_V41.to_hf_dict()["text_config"]["rope_parameters"]
    assert parse_model_config(text | {"rope_parameters": params}) == TINY_V41       # rope_parameters alone


def test_nulls_mean_defaults_and_eos_lists_take_the_first():
    d = _bare(bos_token_id=None, eos_token_id=[1, 7], pad_token_id=None, dtype=None, candidate_source_layer_id=None)
    assert parse_model_config(d) == TINY_V41


# ----------------------------------------------------------------------------- conflicts

@pytest.mark.parametrize("changes, fragments", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8, "original_max_position_embeddings": 256}},
     ("rope_parameters", "rope_scaling", "disagree")),
    ({"rope_factor": 2, "original_seq_len": 256}, ("rope_factor/original_seq_len", "disagree")),
    ({"rope_theta": 5000.0}, ("rope_theta", "keep one")),
    ({"layer_types": ["sliding_attention"] * 10}, ("layer_types", "kv_source_layer_ids")),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, ("dtype", "torch_dtype", "keep one")),
    ({"expert_dtype": "fp8"}, ("expert_dtype", "quantization_config.expert_dtype")),
    ({"quantization_config": {"quant_method": "awq"}}, ("quant_method", "awq")),
    ({"num_key_value_heads": 8}, ("num_key_value_heads=8", "not supported")),
    ({"hidden_act": "gelu"}, ("hidden_act",)),
    ({"num_hash_layers": 3}, ("num_hash_layers",)),
    ({"q_lora": 3}, ("keys deepinfer does not know", "q_lora")),
    ({"kv_source_layer_ids": "2,4"}, ("kv_source_layer_ids must be a list of integers",)),
    ({"hidden_size": "64"}, ("hidden_size must be an integer",)),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2}, "compress": {"rope_type": "default"}}},
     ("rope_parameters.main",)),
])
def test_conflicting_or_unsupported_keys(changes, fragments):
    d = _bare()
    if "quantization_config" in changes:
        d.pop("quantization_config")
    config_error(d | changes, *fragments)


def test_composite_eos_list_at_the_top_level_agrees_with_text_config():
    d = _hf()
    d["eos_token_id"] = [d["text_config"]["eos_token_id"], 7]
    assert parse_model_config(d) == TINY_V41


def test_composite_top_level_and_text_config_conflicts():
    d = _hf()
    d["image_token_id"], d["text_config"]["image_token_id"] = 4, 5
    config_error(d, "image_token_id", "text_config", "keep one")
    d = _hf()
    d["text_config"]["quantization_config"] = dict(d["quantization_config"], weight_block_size=[128, 128])
    config_error(d, "quantization_config")
    config_error(_hf(model_type="deepseek_v4"), "model_type", "deepseek_v41")
    config_error(_hf() | {"vision_config": 3}, "vision_config")


def test_yarn_attention_factor_must_be_one():
    d = _hf()
    d["text_config"]["rope_parameters"]["compress"]["attention_factor"] = 1.2
    config_error(d, "attention_factor", "mscale")


def test_partial_rotary_factor_must_match_the_dims():
    d = _hf()
    d["text_config"]["rope_parameters"]["main"]["partial_rotary_factor"] = 0.5
    config_error(d, "partial_rotary_factor", "qk_rope_head_dim=32")


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("changes, fragments", [
    ({"compress_ratios": [0, 0, 2, 2]}, ("compress_ratios has 4 entries", "num_hidden_layers is 10")),
    ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0]}, ("14 entries",)),
    ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 1, 0]}, ("DSpark", "must be 0")),
    ({"engram_num_embeddings": [384]}, ("engram_num_embeddings has 1 entries", "engram_layer_ids has 2")),
    ({"engram_num_embeddings": [384, 0]}, ("engram_num_embeddings", ">= 1")),
    ({"kv_source_layer_ids": [2, 4, 10]}, ("kv_source_layer_ids", "outside 0..9")),
    ({"kv_source_layer_ids": [2, 6, 4]}, ("kv_source_layer_ids", "strictly increasing")),
    ({"kv_source_layer_ids": [1, 2, 4, 6]}, ("kv_source_layer_ids", "[1]", "compress_ratio is 0")),
    ({"index_source_layer_ids": [1, 2, 4, 6, 8]}, ("index_source_layer_ids", "compress_ratio is 0")),
    ({"index_source_layer_ids": [2, 4, 6, 8, 8]}, ("index_source_layer_ids", "strictly increasing")),
    ({"compress_ratios": [0, 2, 2, 2, 2, 2, 1, 1, 1, 1], "index_source_layer_ids": [1, 2, 4, 6, 8]},
     ("index sources [1]", "before any KV source")),
    ({"compress_ratios": [0, 2, 2, 2, 2, 2, 1, 1, 1, 1]}, ("layers [1]", "no KV source at or before")),
    ({"compress_ratios": [0, 0, 2, 1, 2, 2, 1, 1, 1, 1]}, ("layer 3 (compress_ratio 1) reads KV source 2",)),
    ({"kv_source_layer_ids": [2, 4]}, ("layer 6 (compress_ratio 1) reads KV source 4",)),
    ({"kv_source_layer_ids": [2, 4, 6], "index_source_layer_ids": [2, 6, 8]}, ("KV sources [4]", "index sources")),
    ({"candidate_source_layer_id": 7}, ("candidate_source_layer_id=7", "index_source_layer_ids")),
    ({"dspark_target_layer_ids": [7, 8, 10]}, ("dspark_target_layer_ids", "outside 0..9")),
    ({"dspark_target_layer_ids": [7, 7, 9]}, ("dspark_target_layer_ids", "strictly increasing")),
    ({"dspark_target_layer_ids": [9, 7, 8]}, ("dspark_target_layer_ids", "strictly increasing")),
    ({"engram_layer_ids": [1, 12]}, ("engram_layer_ids", "outside 0..9")),
    ({"engram_layer_ids": [4, 1]}, ("engram_layer_ids", "strictly increasing")),
    ({"hidden_size": 0}, ("hidden_size=0 must be >= 1",)),
    ({"index_topk": 0}, ("index_topk=0",)),
    ({"dspark_block_size": 0}, ("dspark_block_size=0 must be >= 1",)),
    ({"head_dim": 95, "qk_rope_head_dim": 31}, ("head_dim=95 must be even",)),
    ({"qk_rope_head_dim": 31}, ("qk_rope_head_dim=31", "even")),
    ({"qk_rope_head_dim": 128}, ("qk_rope_head_dim=128", "within head_dim=96")),
    ({"o_groups": 3}, ("num_attention_heads=4 is not divisible by o_groups=3",)),
    ({"num_experts_per_tok": 9}, ("num_experts_per_tok=9 exceeds n_routed_experts=8",)),
    ({"dspark_num_experts_per_tok": 5}, ("dspark_num_experts_per_tok=5",)),
    ({"scoring_func": "relu"}, ("unknown scoring_func 'relu'",)),
    ({"dspark_noise_token_id": 512}, ("dspark_noise_token_id=512", "vocabulary 0..511")),
    ({"engram_pad_id": -1}, ("engram_pad_id=-1", "vocabulary")),
    ({"bos_token_id": 600}, ("bos_token_id=600",)),
    ({"eos_token_id": [512]}, ("eos_token_id=512",)),
    ({"image_token_id": 129264}, ("image_token_id=129264",)),
    ({"rms_norm_eps": 0.0}, ("rms_norm_eps=0.0 must be > 0",)),
    ({"gate_temp": -1.0}, ("gate_temp=-1.0 must be > 0",)),
    ({"engram_max_ngram_size": 1}, ("engram_max_ngram_size=1 must be >= 2",)),
    ({"num_hidden_layers": 0}, ("num_hidden_layers=0",)),
])
def test_each_inconsistency_has_one_clear_line(changes, fragments):
    msg = config_error(_plain(**changes), *fragments)
    assert msg.startswith("inconsistent deepseek_v41 config: ") or "config.json" in msg


def test_the_released_schedule_passes_our_stricter_rules():
    # groups: 2..7 read 2, 8..13 read 8, 14..19 read 14 (ratio 2); 20..39 read 20 (ratio 1)
    assert [FLASH_V41.kv_source_of(i) for i in range(40)] == [None] * 2 + [2] * 6 + [8] * 6 + [14] * 6 + [20] * 20
    kinds = [FLASH_V41.layer_kind(i) for i in range(40)]
    assert [i for i, k in enumerate(kinds) if k == KV_SOURCE] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == INDEX_SOURCE] == [24, 28, 32, 36]
    assert kinds[:2] == [SLIDING_ONLY] * 2 and FLASH_V41.truncation_start == 20


# ----------------------------------------------------------------------------- transformers' defaults

def _derived(**text) -> DeepseekV41Config:
    return parse_model_config({"model_type": "deepseek_v41_text", **text})


def test_defaults_for_ten_layers_without_a_schedule():
    cfg = _derived(num_hidden_layers=10)
    # 2 sliding, (10 - 2 + 1) // 2 = 4 ratio-2, 4 ratio-1; not a prefix of the released schedule, so the sources are
    # the first layer of each run, index sources = KV sources, candidate = last KV source
    assert cfg.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1)
    assert cfg.kv_source_layer_ids == (2, 6) and cfg.index_source_layer_ids == (2, 6)
    assert cfg.candidate_source_layer_id == 6
    assert cfg.dspark_target_layer_ids == (7, 8, 9)
    assert cfg.engram_layer_ids == () and cfg.engram_num_embeddings == ()
    assert cfg.rope_scaling is None and cfg.quant is None and not cfg.has_vision


def test_defaults_for_forty_layers_are_the_released_schedule():
    cfg = _derived()
    assert list(cfg.compress_ratios) == RELEASED_RATIOS[:40]
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20) and cfg.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert cfg.candidate_source_layer_id == 20 and cfg.dspark_target_layer_ids == (37, 38, 39)
    assert _derived(compress_ratios=RELEASED_RATIOS) == cfg


def test_defaults_for_other_layer_counts():
    cfg = _derived(num_hidden_layers=7)
    assert cfg.compress_ratios == (0, 0, 2, 2, 2, 1, 1) and cfg.kv_source_layer_ids == (2, 5)
    assert cfg.dspark_target_layer_ids == (3, 4, 6)
    cfg = _derived(num_hidden_layers=5, compress_ratios=[0, 2, 2, 1, 1], num_nextn_predict_layers=0)
    assert cfg.kv_source_layer_ids == (1, 3) and cfg.index_source_layer_ids == (1, 3)
    assert cfg.dspark_target_layer_ids == (0, 2, 4)
    # explicit sources that differ from the released ones: index sources default to them
    cfg = _derived(num_hidden_layers=40, kv_source_layer_ids=[2, 20])
    assert cfg.index_source_layer_ids == (2, 20) and cfg.candidate_source_layer_id == 20
    # a negative candidate disables the two-level top-k; no KV sources at all give -1
    assert _derived(num_hidden_layers=10, candidate_source_layer_id=-5).candidate_source_layer_id == -1
    assert _derived(num_hidden_layers=3, compress_ratios=[0, 0, 0]).candidate_source_layer_id == -1


def test_schedule_that_is_a_released_prefix_gets_the_released_sources_as_transformers_does():
    # [0, 0] and [0, 0, 2] are prefixes of the released schedule: transformers assigns sources [2, 8, 14, 20]
    for n in (2, 3):
        config_error({"model_type": "deepseek_v41_text", "num_hidden_layers": n}, "kv_source_layer_ids",
                     f"outside 0..{n - 1}")


def test_compress_ratios_may_carry_some_or_all_dspark_entries():
    base = {"model_type": "deepseek_v41_text", "num_hidden_layers": 40}
    for tail in ([], [0], [0, 0, 0]):
        assert _derived(**base, compress_ratios=RELEASED_RATIOS[:40] + tail) == _derived(**base)


def test_absent_engram_rows_follow_from_the_primes():
    d = _bare()
    d.pop("engram_num_embeddings")
    assert parse_model_config(d) == TINY_V41


# ----------------------------------------------------------------------------- presets

def test_flash_preset_is_the_release():
    c = FLASH_V41
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim) == \
        (40, 5120, 64, 512, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.n_routed_experts, c.num_experts_per_tok) == \
        (1280, 8, 1024, 384, 6)
    assert c.rope_scaling == YarnScaling(16, 65536, 32, 1) and c.rms_norm_eps == 1e-20 and not c.has_vision
    assert c.quant == WeightQuant(weight_block_size=(32, 32), scale_fmt="ue8m0", expert_dtype="fp4")
    assert (c.dspark_block_size, c.dspark_noise_token_id, c.dspark_markov_rank) == (5, 128799, 256)


def _kinds(cfg: DeepseekV41Config) -> set[str]:
    """The layer kinds of the release, by name."""
    r, kinds = cfg.compress_ratios, set()
    for i in range(cfg.num_hidden_layers):
        kind, src = cfg.layer_kind(i), cfg.kv_source_of(i)
        kinds.add({SLIDING_ONLY: "sliding", KV_SOURCE: f"r{r[i]} source", INDEX_SOURCE: "reindex",
                   REUSE: f"r{r[i]} reuse"}[kind])
        if kind == REUSE and any(src < s <= i for s in cfg.index_source_layer_ids if s not in cfg.kv_source_layer_ids):
            kinds.add("reuse after reindex")
    if cfg.candidate_source_layer_id >= 0:
        kinds.add(f"r{r[cfg.candidate_source_layer_id]} candidate")
    kinds.update(f"engram on {cfg.layer_kind(e)}" for e in cfg.engram_layer_ids)
    if sum(r[s] == 2 for s in cfg.kv_source_layer_ids) >= 2:
        kinds.add("second r2 source")
    return kinds


ALL_KINDS = {"sliding", "r2 source", "r2 reuse", "r1 source", "r1 reuse", "reindex", "reuse after reindex",
             "r1 candidate", "engram on sliding", "engram on kv_source", "second r2 source"}


def test_presets_validate_and_hold_every_layer_kind():
    for cfg in PRESETS.values():
        assert parse_deepseek_v41(cfg.to_hf_dict()) == cfg
        assert _kinds(cfg) == ALL_KINDS
    assert TINY_V41.engram_num_embeddings == engram_table_rows(50, 2, 4, 2) == (384, 552)
    assert TINY_V41.dspark_target_layer_ids == (7, 8, 9)


def test_flash_layer_reductions():
    four = preset_config("deepseek_v41", "flash", layers=4)
    assert four.compress_ratios == (0, 2, 1, 1) and four.kv_source_layer_ids == (1, 2)
    assert four.index_source_layer_ids == (1, 2, 3) and four.candidate_source_layer_id == 2
    eight = preset_config("deepseek_v41", "flash", layers=8)
    assert eight.compress_ratios == (0, 0, 2, 2, 1, 1, 1, 1) and eight.engram_layer_ids == (1,)
    assert _kinds(eight) == ALL_KINDS - {"engram on kv_source", "second r2 source"}
    ten = preset_config("deepseek_v41", "flash", layers=10)
    schedule = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                "engram_layer_ids", "dspark_target_layer_ids")
    assert all(getattr(ten, k) == getattr(TINY_V41, k) for k in schedule)
    assert ten.engram_num_embeddings == FLASH_V41.engram_num_embeddings and _kinds(ten) == ALL_KINDS
    assert preset_config("deepseek_v41", "flash", layers=40) == FLASH_V41
    for n in range(1, 41):   # every prefix of the priority order is a valid config
        cfg = preset_config("deepseek_v41", "flash", layers=n)
        assert cfg.num_hidden_layers == n and parse_deepseek_v41(cfg.to_deepseek_dict()) == cfg
        if n >= 9:
            assert _kinds(cfg) == ALL_KINDS, n
    assert v41_layer_priority(TINY_V41) == [0, 2, 6, 8, 1, 3, 7, 9, 4, 5]
    assert preset_config("deepseek_v41", "tiny", layers=4).compress_ratios == (0, 2, 1, 1)


def test_preset_errors_and_v4_presets_unchanged():
    with pytest.raises(ConfigError, match="outside 1..40"):
        preset_config("deepseek_v41", "flash", layers=41)
    with pytest.raises(ConfigError, match="no preset"):
        preset_config("deepseek_v41", "huge")
    with pytest.raises(ConfigError, match="deepseek_v41 only"):
        preset_config("deepseek_v4", "tiny", engram_vocab_size=100)
    assert preset_config("deepseek_v4", "tiny", layers=2).num_hidden_layers == 2


def test_engram_vocab_size_reduction_recomputes_rows():
    cfg = preset_config("deepseek_v41", "flash", layers=10, engram_vocab_size=1000)
    layout = engram_prime_layout(1000, 2, 4, 8)
    assert cfg.engram_vocab_size == 1000
    assert cfg.engram_num_embeddings == tuple(sum(map(sum, layer)) for layer in layout)
    assert preset_config("deepseek_v41", "tiny", engram_vocab_size=50) == TINY_V41


def test_engram_prime_layout_rules():
    # every (layer, order) restarts at vocab - 1, so with a global "taken" set the primes are simply the next ones
    # above 999, in (layer, order, head) order: 1009, 1013, 1019, ...
    flat = [p for layer in engram_prime_layout(1000, 2, 4, 8) for order in layer for p in order]
    sympy = pytest.importorskip("sympy")
    assert flat == [sympy.prime(sympy.primepi(999) + k) for k in range(1, 49)]


def test_engram_prime_layout_tiny():
    layout = engram_prime_layout(50, 2, 4, 2)
    assert layout == [[[53, 59], [61, 67], [71, 73]], [[79, 83], [89, 97], [101, 103]]]


def test_released_engram_rows_are_the_prime_sums():
    start = time.perf_counter()
    assert engram_table_rows(16000000, 2, 4, 8) == (384006168, 384016682)
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("change, match", [
    ({"head_dim": 80, "qk_rope_head_dim": 16}, "head_dim=80 must be a multiple of 32"),
    ({"index_head_dim": 48}, "index_head_dim=48 must be a multiple of 32"),
    ({"dspark_target_layer_ids": ()}, "DSpark stages need dspark_target_layer_ids"),
    ({"candidate_source_layer_id": 4}, "come after candidate_source_layer_id=4"),
])
def test_schedule_rules_added_after_review(change, match):
    from deepinfer.config.deepseek_v41 import validate
    with pytest.raises(ConfigError, match=match):
        validate(dataclasses.replace(TINY_V41, **change))
