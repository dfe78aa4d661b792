"""config.json parsing: the three spellings agree, the released V4-Flash schedule reads right, transformers
reads our export the same way, and inconsistent configs fail with one clear ConfigError line."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from deepinfer.config import load_model_config, parse_model_config
from deepinfer.config.deepseek_v4 import (CSA, HASH_MOE, HCA, MOE, SLIDING, DeepseekV4Config, WeightQuant,
                                          YarnScaling)
from deepinfer.config.presets import FLASH_V4, TINY_V4
from tests.helpers import config_error

# DeepSeek's inference ModelArgs spelling, written out by hand key by key (not by our writers), so a preset
# change is followed automatically while the spelling itself stays independent of deepseek_v4.py.
def inference_args(cfg) -> dict:
    rates = dict(cfg.compress_rates)
    ratios = [0 if t == SLIDING else rates[t] for t in cfg.layer_types] + [0] * cfg.num_nextn_predict_layers
    return {
        "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "dim": cfg.hidden_size, "n_layers": cfg.num_hidden_layers,
        "n_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "rope_head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": cfg.n_shared_experts,
        "n_activated_experts": cfg.num_experts_per_tok, "moe_inter_dim": cfg.moe_intermediate_size,
        "score_func": cfg.scoring_func, "route_scale": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "window_size": cfg.sliding_window, "compress_ratios": ratios,
        "n_hash_layers": sum(t == HASH_MOE for t in cfg.mlp_layer_types),
        "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "compress_rope_theta": cfg.compress_rope_theta,
        "rope_factor": cfg.rope_scaling.factor, "original_seq_len": cfg.rope_scaling.original_max_position_embeddings,
        "beta_fast": cfg.rope_scaling.beta_fast, "beta_slow": cfg.rope_scaling.beta_slow,
        "n_mtp_layers": cfg.num_nextn_predict_layers, "max_position_embeddings": cfg.max_position_embeddings,
        "max_seq_len": 4096, "max_batch_size": 8,
        "dtype": "fp8", "scale_fmt": cfg.quant.scale_fmt, "expert_dtype": cfg.quant.expert_dtype,
    }


RELEASED_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]   # 43 layers + 1 MTP

# The released V4-Flash dims in ModelArgs spelling, literally.
FLASH_INFERENCE_ARGS = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280, "dim": 4096, "n_layers": 43, "n_heads": 64, "head_dim": 512, "rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6, "moe_inter_dim": 2048,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0,
    "window_size": 128, "compress_ratios": RELEASED_FLASH_RATIOS, "n_hash_layers": 3,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-6,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_factor": 16, "original_seq_len": 65536, "beta_fast": 32, "beta_slow": 1,
    "n_mtp_layers": 1, "dtype": "fp8", "scale_fmt": "ue8m0", "expert_dtype": "fp4",
}

PRESETS = {"tiny": TINY_V4, "flash": FLASH_V4}


# ----------------------------------------------------------------------------- spellings

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_three_spellings_parse_to_equal_configs(preset):
    cfg = PRESETS[preset]
    from_deepseek = parse_model_config(cfg.to_deepseek_dict())
    from_hf = parse_model_config(cfg.to_hf_dict())
    from_inference = parse_model_config(inference_args(cfg))
    assert from_deepseek == cfg
    assert from_inference == cfg
    # transformers' spelling carries no quantization_config: it describes the dequantized weights ...
    assert from_hf == dataclasses.replace(cfg, quant=None)
    # ... and with the release's quantization_config (as on the hub) it is the same config again.
    hf_quantized = cfg.to_hf_dict() | {"quantization_config": cfg.to_deepseek_dict()["quantization_config"],
                                       "expert_dtype": "fp4"}
    assert parse_model_config(hf_quantized) == cfg
    assert len({c.config_hash() for c in (from_deepseek, from_hf, from_inference)}) == 1


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_writers_round_trip(preset):
    cfg = PRESETS[preset]
    for write in (type(cfg).to_deepseek_dict, type(cfg).to_hf_dict):
        again = parse_model_config(write(cfg))
        assert write(again) == write(cfg)
        assert parse_model_config(write(again)) == again


def test_load_model_config_reads_a_file(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(BASE.to_deepseek_dict()))
    assert load_model_config(tmp_path) == BASE
    assert load_model_config(tmp_path / "config.json") == BASE


def test_nulls_mean_defaults_and_eos_lists_take_the_first():
    d = BASE.to_hf_dict() | {"bos_token_id": None, "pad_token_id": None, "eos_token_id": [1, 7],
                             "torch_dtype": None, "rope_scaling": None}
    assert parse_model_config(d) == dataclasses.replace(BASE, quant=None)


# ----------------------------------------------------------------------------- the released V4-Flash schedule

def test_released_flash_schedule():
    assert len(RELEASED_FLASH_RATIOS) == 44
    cfg = parse_model_config({"model_type": "deepseek_v4", "num_hidden_layers": 43, "num_nextn_predict_layers": 1,
                              "compress_ratios": RELEASED_FLASH_RATIOS, "num_hash_layers": 3})
    assert cfg.layer_types[:2] == (SLIDING, SLIDING)
    for i in range(2, 43):
        assert cfg.layer_types[i] == (CSA if i % 2 == 0 else HCA), i
    assert [i for i, t in enumerate(cfg.layer_types) if t == CSA] == list(range(2, 43, 2))
    assert [i for i, t in enumerate(cfg.layer_types) if t == HCA] == list(range(3, 42, 2))
    assert cfg.mlp_layer_types == (HASH_MOE,) * 3 + (MOE,) * 40
    assert cfg.num_hash_layers == 3
    assert dict(cfg.compress_rates) == {CSA: 4, HCA: 128}
    assert cfg.compress_ratios == RELEASED_FLASH_RATIOS[:43]
    assert cfg.to_deepseek_dict()["compress_ratios"] == RELEASED_FLASH_RATIOS
    assert FLASH_V4.to_deepseek_dict()["compress_ratios"] == RELEASED_FLASH_RATIOS
    assert cfg.layer_types == FLASH_V4.layer_types and cfg.mlp_layer_types == FLASH_V4.mlp_layer_types
    # the released dims, in DeepSeek's inference spelling, are the flash preset
    assert parse_model_config(FLASH_INFERENCE_ARGS) == FLASH_V4


def test_compress_ratios_without_mtp_entries():
    cfg = parse_model_config({"model_type": "deepseek_v4", "num_hidden_layers": 43,
                              "compress_ratios": RELEASED_FLASH_RATIOS[:43]})
    assert cfg.layer_types == FLASH_V4.layer_types


# ----------------------------------------------------------------------------- transformers reads our export

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_hf_dict_loads_into_transformers(preset, tmp_path, transformers_v4_reference):
    transformers = transformers_v4_reference
    cfg = PRESETS[preset]
    d = cfg.to_hf_dict()
    expected = copy.deepcopy(d)
    d.pop("model_type")
    d.pop("architectures")
    hf = transformers.DeepseekV4Config(**d)
    assert list(hf.layer_types) == expected["layer_types"] == list(cfg.layer_types)
    assert list(hf.mlp_layer_types) == expected["mlp_layer_types"] == list(cfg.mlp_layer_types)
    assert hf.partial_rotary_factor == expected["partial_rotary_factor"] == cfg.qk_rope_head_dim / cfg.head_dim
    assert dict(hf.compress_rates) == expected["compress_rates"] == dict(cfg.compress_rates)
    assert hf.rope_parameters == expected["rope_parameters"]
    assert hf.rope_parameters["compress"]["rope_type"] == "yarn"
    assert hf.rope_parameters["compress"]["factor"] == cfg.rope_scaling.factor
    # and transformers' own config, as a dict and as saved by save_pretrained, parses to the same model
    assert parse_model_config(hf.to_dict()) == dataclasses.replace(cfg, quant=None)
    hf.save_pretrained(tmp_path)
    assert load_model_config(tmp_path) == dataclasses.replace(cfg, quant=None)


def test_transformers_reads_the_release_spelling_like_we_do(transformers_v4_reference):
    transformers = transformers_v4_reference
    d = FLASH_V4.to_deepseek_dict()
    for key in ("model_type", "architectures", "quantization_config", "expert_dtype", "topk_method", "rope_scaling"):
        d.pop(key, None)
    hf = transformers.DeepseekV4Config(**d)
    assert list(hf.layer_types) == list(FLASH_V4.layer_types)
    assert list(hf.mlp_layer_types) == list(FLASH_V4.mlp_layer_types)


# ----------------------------------------------------------------------------- inconsistent configs

# A fixed small config (independent of the presets, which may change): 4 layers S/CSA/HCA/CSA, 4 heads of 96,
# rope 32, o_groups 2, 8 experts top-2, vocab 512.
BASE = DeepseekV4Config(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=96,
    qk_rope_head_dim=32, q_lora_rank=48, o_groups=2, o_lora_rank=32, n_routed_experts=8,
    n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=16,
    layer_types=(SLIDING, CSA, HCA, CSA), compress_rates=((CSA, 4), (HCA, 16)),
    mlp_layer_types=(HASH_MOE, HASH_MOE, MOE, MOE), index_n_heads=8, index_head_dim=64, index_topk=8,
    rope_scaling=YarnScaling(factor=4, original_max_position_embeddings=256),
    max_position_embeddings=1024, quant=WeightQuant(),
)


def _ds(**changes) -> dict:
    return BASE.to_deepseek_dict() | changes


def _hf(**changes) -> dict:
    return BASE.to_hf_dict() | changes


def test_base_is_valid():
    assert parse_model_config(_ds()) == BASE
    assert parse_model_config(_hf()) == dataclasses.replace(BASE, quant=None)


BAD_CONFIGS = {
    "compress_ratios-short": (_ds(compress_ratios=[0, 4, 16]), ["compress_ratios", "3 entries", "num_hidden_layers is 4"]),
    "compress_ratios-long": (_ds(compress_ratios=[0, 4, 16, 4, 0, 0, 0]), ["compress_ratios", "7 entries"]),
    "compress_ratios-not-ints": (_ds(compress_ratios=[0, "4", 16, 4]), ["compress_ratios", "integers"]),
    "compress_ratios-two-hca": (_ds(compress_ratios=[0, 4, 16, 32, 0]), ["compress_ratios", "[16, 32]"]),
    "layer_types-short": (_hf(layer_types=[SLIDING, CSA, HCA]), ["layer_types has 3 entries", "num_hidden_layers is 4"]),
    "layer_types-long": (_hf(layer_types=[SLIDING] * 5), ["layer_types has 5 entries"]),
    "layer_types-unknown": (_hf(layer_types=[SLIDING, "full_attention", HCA, CSA]),
                            ["layer_types", "'full_attention'", SLIDING]),
    "layer_types-not-a-list": (_hf(layer_types="sliding_attention"), ["layer_types must be a list"]),
    "layer_types-vs-compress_ratios": (_hf(compress_ratios=[0, 0, 16, 4, 0]),
                                       ["layer_types", "compress_ratios", "disagree"]),
    "no-schedule": ({k: v for k, v in _ds().items() if k != "compress_ratios"}, ["layer_types", "compress_ratios"]),
    "num_hash_layers-too-many": (_ds(num_hash_layers=5), ["num_hash_layers=5", "num_hidden_layers (4)"]),
    "num_hash_layers-negative": (_ds(num_hash_layers=-1), ["num_hash_layers=-1"]),
    "mlp_layer_types-bad": (_hf(mlp_layer_types=[HASH_MOE, "dense", MOE, MOE]), ["mlp_layer_types", "'dense'"]),
    "mlp_layer_types-short": (_hf(mlp_layer_types=[HASH_MOE]), ["mlp_layer_types", "4 entries"]),
    "mlp_vs_num_hash_layers": (_hf(num_hash_layers=1), ["mlp_layer_types", "num_hash_layers", "disagree"]),
    "qk_rope_head_dim-odd": (_ds(qk_rope_head_dim=31), ["qk_rope_head_dim=31", "even"]),
    "qk_rope_head_dim-too-big": (_ds(qk_rope_head_dim=128), ["qk_rope_head_dim=128", "head_dim=96"]),
    "qk_rope_head_dim-zero": (_ds(qk_rope_head_dim=0), ["qk_rope_head_dim=0"]),
    "partial_rotary_factor-too-big": (_hf(partial_rotary_factor=1.5), ["qk_rope_head_dim=144", "head_dim=96"]),
    "rope-dim-spellings-disagree": (_hf(qk_rope_head_dim=16), ["qk_rope_head_dim=16", "partial_rotary_factor"]),
    "o_groups-not-dividing": (_ds(o_groups=3), ["num_attention_heads=4", "o_groups=3"]),
    "o_groups-zero": (_ds(o_groups=0), ["o_groups=0"]),
    "topk-more-than-experts": (_ds(num_experts_per_tok=9), ["num_experts_per_tok=9", "n_routed_experts=8"]),
    "topk-zero": (_ds(num_experts_per_tok=0), ["num_experts_per_tok=0"]),
    "unknown-keys": (_ds(zeta_factor=2, alpha_mode="x"), ["['alpha_mode', 'zeta_factor']", "deepseek_v4"]),
    "alias-conflict": (_ds(dim=128), ["dim=128", "hidden_size=64"]),
    "wrong-type-int": (_ds(hidden_size="64"), ["hidden_size", "integer", "'64'"]),
    "wrong-type-bool": (_ds(norm_topk_prob="yes"), ["norm_topk_prob", "'yes'"]),
    "wrong-type-float": (_ds(rms_norm_eps=[1e-6]), ["rms_norm_eps", "number"]),
    "num_hidden_layers-not-int": (_ds(num_hidden_layers="four"), ["num_hidden_layers", "'four'"]),
    "num_hidden_layers-zero": (_ds(num_hidden_layers=0, compress_ratios=[]), ["num_hidden_layers=0"]),
    "scoring_func": (_ds(scoring_func="relu"), ["scoring_func", "'relu'"]),
    "compress_rates-unknown": (_hf(compress_rates={CSA: 4, "full_attention": 2}), ["compress_rates", "full_attention"]),
    "compress_rates-not-dict": (_hf(compress_rates=[4, 16]), ["compress_rates", "[4, 16]"]),
    "compress_rates-zero": (_hf(compress_rates={CSA: 4, HCA: 0}), ["compress_rates", HCA]),
    "quantization_config": (_ds(quantization_config={"quant_method": "fp8", "scale_fmt": "e5m2"}),
                            ["quantization_config", "'e5m2'"]),
    "bos-outside-vocab": (_ds(bos_token_id=600), ["bos/eos", "vocabulary"]),
    "rope_scaling-no-factor": (_ds(rope_scaling={"type": "yarn", "original_max_position_embeddings": 256}),
                               ["rope_scaling", "factor is missing"]),
    "rope_scaling-no-original": (_ds(rope_scaling={"type": "yarn", "factor": 4}),
                                 ["rope_scaling", "original_max_position_embeddings is missing"]),
    "rope_scaling-factor-string": (_ds(rope_scaling={"type": "yarn", "factor": "four",
                                                     "original_max_position_embeddings": 256}),
                                   ["rope_scaling", "factor must be a number", "'four'"]),
    "rope_scaling-string": (_ds(rope_scaling="yarn"), ["rope_scaling", "must be an object", "'yarn'"]),
    "rope_scaling-list": (_ds(rope_scaling=[4, 256]), ["rope_scaling", "must be an object"]),
    "rope_scaling-linear": (_ds(rope_scaling={"type": "linear", "factor": 4}), ["rope_scaling", "'linear'", "yarn"]),
    "rope_scaling-factor-below-1": (_ds(rope_scaling={"type": "yarn", "factor": 0.5,
                                                      "original_max_position_embeddings": 256}),
                                    ["rope_scaling", "factor >= 1"]),
    "rope_parameters-compress-no-factor": (
        _hf(rope_parameters={"main": {"rope_type": "default", "rope_theta": 1e4},
                             "compress": {"rope_type": "yarn", "rope_theta": 1.6e5,
                                          "original_max_position_embeddings": 256}}),
        ["rope_parameters.compress", "factor is missing"]),
    "rope_parameters-not-dict": (_hf(rope_parameters="yarn"), ["rope_parameters", "must be an object"]),
    "rope_parameters-bad-theta": (_hf(rope_parameters={"main": {"rope_theta": -1}, "compress": {}}),
                                  ["rope_parameters.main.rope_theta", "-1"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_inconsistent_config_is_rejected(case):
    raw, fragments = BAD_CONFIGS[case]
    config_error(raw, *fragments)


def test_not_a_dict_and_unknown_model_type():
    config_error([1, 2], "JSON object")
    config_error(_ds(model_type="deepseek_v3"), "model_type", "'deepseek_v3'", "deepseek_v4")
    config_error({k: v for k, v in _ds().items() if k != "model_type"}, "model_type", "None")
