"""What both config parsers share: the dataclasses of the YaRN scaling and the on-disk weight format, DeepSeek's
inference spellings, and the typed readers of a JSON value."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError

# DeepSeek inference ModelArgs key -> canonical key
INFERENCE_ALIASES = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "rope_head_dim": "qk_rope_head_dim",
    "moe_inter_dim": "moe_intermediate_size",
    "n_activated_experts": "num_experts_per_tok",
    "score_func": "scoring_func",
    "route_scale": "routed_scaling_factor",
    "window_size": "sliding_window",
    "norm_eps": "rms_norm_eps",
    "n_mtp_layers": "num_nextn_predict_layers",
    "n_hash_layers": "num_hash_layers",
}
INFERENCE_YARN_KEYS = {"rope_factor": "factor", "original_seq_len": "original_max_position_embeddings",
                        "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
# Keys that carry no model math (training, HF bookkeeping) and are accepted silently.
IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "pad_token_id", "keys_to_ignore_at_inference",
    "topk_method", "n_group", "topk_group", "first_k_dense_replace", "moe_layer_freq", "aux_loss_alpha",
    "seq_aux", "ep_size", "kv_lora_rank", "num_key_value_heads", "max_batch_size", "max_seq_len",
    "scale_fmt", "scale_dtype", "expert_dtype", "quantization_config", "model_type", "text_config",
    "_name_or_path", "return_dict", "tie_word_embeddings", "chunk_size_feed_forward", "is_encoder_decoder",
    "index_topk_method", "n_routed_experts_per_rank", "id2label", "label2id", "problem_type",
    "output_attentions", "output_hidden_states",
}


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class WeightQuant:
    """How weights are stored on disk (None on the config means plain bf16/fp32)."""
    dense_fmt: str = "fp8"                 # FP8 e4m3 dense weights
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"               # "ue8m0" (e8m0 bytes) or "float32"
    expert_dtype: str = "fp4"              # "fp4" (e2m1 packed, e8m0 per 32 along K) or "fp8"


def as_int(raw: dict, key: str, default=None) -> int:
    v = raw.get(key, default)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"config.json: {key} must be an integer, got {v!r}")
    return v


def check_types(kw: dict, cls) -> None:
    """Scalar fields of `cls` must hold JSON values of their declared kind (int, float, bool, str)."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, v in kw.items():
        kind = kinds.get(key)
        if kind == "int":
            if isinstance(v, float) and v.is_integer():
                kw[key] = v = int(v)
            ok, what = isinstance(v, int) and not isinstance(v, bool), "an integer"
        elif kind == "float":
            ok, what = isinstance(v, (int, float)) and not isinstance(v, bool), "a number"
            if ok:
                kw[key] = float(v)
        elif kind == "bool":
            ok, what = isinstance(v, bool), "true or false"
        elif kind == "str":
            ok, what = isinstance(v, str), "a string"
        else:
            continue
        if not ok:
            raise ConfigError(f"config.json: {key} must be {what}, got {v!r}")


def parse_rope(raw: dict, yarn_inference: dict) -> tuple[YarnScaling | None, dict]:
    kw = {}
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config.json: rope_parameters must be an object, got {params!r}")
    yarn, source = None, None
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params.get("main") or {}, params["compress"]
        if not isinstance(main, dict):
            raise ConfigError(f"config.json: rope_parameters.main must be an object, got {main!r}")
        for sub, key, entry in (("main", "rope_theta", main), ("compress", "compress_rope_theta", comp)):
            if "rope_theta" in entry:
                theta = entry["rope_theta"]
                if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
                    raise ConfigError(f"config.json: rope_parameters.{sub}.rope_theta must be a positive number, "
                                      f"got {theta!r}")
                kw[key] = float(theta)
        if comp.get("rope_type", comp.get("type", "default")) != "default":
            yarn, source = comp, "rope_parameters.compress"
    elif isinstance(params, dict) and params.get("rope_type", params.get("type", "default")) != "default":
        yarn, source = params, "rope_parameters"
    if raw.get("rope_scaling") is not None:
        yarn, source = raw["rope_scaling"], "rope_scaling"
    if yarn_inference.get("factor", 1) not in (None, 1, 1.0) and yarn is None:
        yarn, source = {"type": "yarn", **yarn_inference}, "rope_factor/original_seq_len"
    if yarn is None:
        return None, kw
    if not isinstance(yarn, dict):
        raise ConfigError(f"config.json: {source} must be an object like {{\"type\": \"yarn\", \"factor\": ..., "
                          f"\"original_max_position_embeddings\": ...}}, got {yarn!r}")
    kind = yarn.get("rope_type", yarn.get("type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"config.json: {source} has type {kind!r}; deepseek_v4 supports only 'yarn' scaling")
    try:
        scaling = YarnScaling(factor=number(yarn, "factor"),
                              original_max_position_embeddings=int(number(yarn, "original_max_position_embeddings")),
                              beta_fast=number(yarn, "beta_fast", 32.0), beta_slow=number(yarn, "beta_slow", 1.0))
    except KeyError as err:
        raise ConfigError(f"config.json: {source} (YaRN) is malformed: {err.args[0]}") from None
    if scaling.factor < 1 or scaling.original_max_position_embeddings < 1:
        raise ConfigError(f"config.json: {source} (YaRN) needs factor >= 1 and original_max_position_embeddings "
                          f">= 1, got {scaling.factor} and {scaling.original_max_position_embeddings}")
    return scaling, kw


def number(d: dict, key: str, default: float | None = None) -> float:
    v = d.get(key)
    if v is None:
        if default is None:
            raise KeyError(f"{key} is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise KeyError(f"{key} must be a number, got {v!r}")
    return float(v)


def parse_quant(raw: dict) -> WeightQuant | None:
    qc = raw.get("quantization_config")
    if not qc:
        # DeepSeek's inference ModelArgs spell quantized weights as dtype="fp8" (+ scale_fmt, expert_dtype).
        if raw.get("dtype") != "fp8":
            return None
        qc = {}
    if not isinstance(qc, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {qc!r}")
    block = qc.get("weight_block_size", (128, 128))
    scale_fmt = qc.get("scale_fmt") or raw.get("scale_fmt") or "float32"
    expert = qc.get("expert_dtype") or raw.get("expert_dtype") or "fp8"
    if (scale_fmt not in ("ue8m0", "float32") or expert not in ("fp4", "fp8") or not isinstance(block, (list, tuple))
            or len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config is not supported: scale_fmt={scale_fmt!r}, "
                          f"expert_dtype={expert!r}, weight_block_size={block!r}")
    return WeightQuant(weight_block_size=(int(block[0]), int(block[1])), scale_fmt=scale_fmt, expert_dtype=expert)
