"""DeepSeek-V4 model config: one typed dataclass read from either key spelling.

Spellings accepted (mixed freely, canonical field names are transformers'):
- transformers: `layer_types`, `mlp_layer_types`, `compress_rates`, `rope_parameters`, `partial_rotary_factor`.
- DeepSeek's release config.json: `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`.
- DeepSeek's inference ModelArgs: `dim`, `n_layers`, `n_heads`, `rope_head_dim`, `window_size`, ...
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from ..errors import ConfigError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"

# DeepSeek inference ModelArgs key -> canonical key
_INFERENCE_ALIASES = {
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
_INFERENCE_YARN_KEYS = {"rope_factor": "factor", "original_seq_len": "original_max_position_embeddings",
                        "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
# Keys that carry no model math (training, HF bookkeeping) and are accepted silently.
_IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "use_cache", "initializer_range",
    "hidden_act", "attention_bias", "mlp_bias", "attention_dropout", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "pad_token_id", "keys_to_ignore_at_inference",
    "topk_method", "n_group", "topk_group", "first_k_dense_replace", "moe_layer_freq", "aux_loss_alpha",
    "seq_aux", "ep_size", "kv_lora_rank", "num_key_value_heads", "max_batch_size", "max_seq_len",
    "scale_fmt", "scale_dtype", "expert_dtype", "quantization_config", "model_type", "text_config",
    "_name_or_path", "return_dict", "tie_word_embeddings", "chunk_size_feed_forward", "is_encoder_decoder",
    "index_topk_method", "n_routed_experts_per_rank", "id2label", "label2id", "problem_type",
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


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 2048
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    layer_types: tuple[str, ...] = ()      # one per main layer
    compress_rates: tuple[tuple[str, int], ...] = ((CSA, 4), (HCA, 128))
    mlp_layer_types: tuple[str, ...] = ()  # one per main layer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None   # YaRN, compressed layers only
    num_nextn_predict_layers: int = 1
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    quant: WeightQuant | None = None
    torch_dtype: str = "bfloat16"
    model_type: str = field(default="deepseek_v4", init=False)

    # ---- derived ----
    def compress_ratio(self, layer: int) -> int:
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else dict(self.compress_rates)[kind]

    @property
    def compress_ratios(self) -> list[int]:
        return [self.compress_ratio(i) for i in range(self.num_hidden_layers)]

    @property
    def num_hash_layers(self) -> int:
        return sum(t == HASH_MOE for t in self.mlp_layer_types)

    def config_hash(self) -> str:
        blob = json.dumps(self.to_hf_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- writers ----
    def to_hf_dict(self) -> dict:
        """transformers' spelling (loads into transformers' DeepseekV4Config)."""
        d = self._common_dict()
        d.update(layer_types=list(self.layer_types), mlp_layer_types=list(self.mlp_layer_types),
                 compress_rates=dict(self.compress_rates),
                 partial_rotary_factor=self.qk_rope_head_dim / self.head_dim)
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim}
        if self.rope_scaling is not None:
            compress.update(rope_type="yarn", attention_factor=1.0,
                            **{k: v for k, v in dataclasses.asdict(self.rope_scaling).items()})
        d["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": self.rope_theta,
                     "partial_rotary_factor": self.qk_rope_head_dim / self.head_dim},
            "compress": compress,
        }
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        return d

    def to_deepseek_dict(self) -> dict:
        """The release config.json spelling: compress_ratios (+ MTP entries), num_hash_layers, rope_scaling."""
        rates = dict(self.compress_rates)
        if rates[CSA] != 4:
            raise ConfigError(f"the DeepSeek config spelling encodes CSA as ratio 4; this config has "
                              f"{rates[CSA]}: write it with --format hf")
        hash_flags = [t == HASH_MOE for t in self.mlp_layer_types]
        if hash_flags != sorted(hash_flags, reverse=True):
            raise ConfigError("the DeepSeek config spelling needs hash-MoE layers first (num_hash_layers); "
                              "write this schedule with --format hf")
        d = self._common_dict()
        d.update(compress_ratios=self.compress_ratios + [0] * self.num_nextn_predict_layers,
                 num_hash_layers=self.num_hash_layers, qk_rope_head_dim=self.qk_rope_head_dim,
                 topk_method="noaux_tc")
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.rope_scaling)}
        if self.quant is not None:
            d["quantization_config"] = {
                "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.quant.weight_block_size), "scale_fmt": self.quant.scale_fmt}
            d["expert_dtype"] = self.quant.expert_dtype
        d["architectures"] = ["DeepseekV4ForCausalLM"]
        return d

    def _common_dict(self) -> dict:
        skip = {"layer_types", "mlp_layer_types", "compress_rates", "rope_scaling", "quant", "qk_rope_head_dim"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


_RATIO_TO_TYPE = {0: SLIDING, 4: CSA}


def parse_deepseek_v4(raw: dict) -> DeepseekV4Config:
    """Read a config dict in any accepted spelling; raise ConfigError with one clear line."""
    raw = dict(raw)
    for old, new in _INFERENCE_ALIASES.items():
        if old in raw:
            raw.setdefault(new, raw.pop(old))
    yarn_inference = {new: raw.pop(old) for old, new in _INFERENCE_YARN_KEYS.items() if old in raw}

    known = {f.name for f in dataclasses.fields(DeepseekV4Config)}
    legacy = {"compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "rope_parameters",
              "partial_rotary_factor", "compress_rate_csa", "compress_rate_hca"}
    unknown = sorted(k for k in raw if k not in known | legacy | _IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json has keys deepinfer does not know for deepseek_v4: {unknown}; "
                          f"remove them or check the model_type")
    explicit = {"model_type", "layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim",
                "rope_scaling", "quant"}
    kw = {k: v for k, v in raw.items() if k in known and k not in explicit}
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    for key in ("bos_token_id", "eos_token_id"):
        if kw.get(key) is None:
            kw.pop(key, None)
    n = int(raw.get("num_hidden_layers", DeepseekV4Config.num_hidden_layers))
    n_mtp = int(raw.get("num_nextn_predict_layers", DeepseekV4Config.num_nextn_predict_layers))

    rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
    if "compress_rate_csa" in raw:
        rates[CSA] = raw["compress_rate_csa"]
    if "compress_rate_hca" in raw:
        rates[HCA] = raw["compress_rate_hca"]
    if raw.get("layer_types") is not None:
        layer_types = list(raw["layer_types"])
    elif raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        if len(ratios) not in (n, n + n_mtp):
            raise ConfigError(f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n} "
                              f"(+{n_mtp} MTP): give one ratio per layer")
        hca = sorted({r for r in ratios[:n] if r not in _RATIO_TO_TYPE})
        if len(hca) > 1:
            raise ConfigError(f"compress_ratios mixes several HCA ratios {hca}; one is supported")
        if hca:
            rates[HCA] = hca[0]
        layer_types = [_RATIO_TO_TYPE.get(r, HCA) for r in ratios[:n]]
    else:
        raise ConfigError("config.json gives neither layer_types nor compress_ratios: "
                          "the per-layer attention schedule is required")
    if len(layer_types) != n:
        raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
    bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ConfigError(f"layer_types has unknown entries {bad}; allowed: {list(LAYER_TYPES)}")

    if raw.get("mlp_layer_types") is not None:
        mlp_types = list(raw["mlp_layer_types"])
        if len(mlp_types) != n or any(t not in (HASH_MOE, MOE) for t in mlp_types):
            raise ConfigError(f"mlp_layer_types must hold {n} entries of 'hash_moe'/'moe'")
    else:
        n_hash = int(raw.get("num_hash_layers", 3))
        if not 0 <= n_hash <= n:
            raise ConfigError(f"num_hash_layers={n_hash} is outside 0..num_hidden_layers ({n})")
        mlp_types = [HASH_MOE] * n_hash + [MOE] * (n - n_hash)

    head_dim = int(raw.get("head_dim", DeepseekV4Config.head_dim))
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = int(raw["qk_rope_head_dim"])
    elif raw.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * float(raw["partial_rotary_factor"])))
    else:
        rope_dim = head_dim // 8

    rope_scaling, kw_rope = _parse_rope(raw, yarn_inference)
    kw.update(kw_rope)
    quant = _parse_quant(raw)
    try:
        cfg = DeepseekV4Config(**kw, layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types),
                               compress_rates=tuple(sorted(rates.items())), qk_rope_head_dim=rope_dim,
                               rope_scaling=rope_scaling, quant=quant)
    except TypeError as err:
        raise ConfigError(f"config.json is malformed: {err}") from None
    validate(cfg)
    return cfg


def _parse_rope(raw: dict, yarn_inference: dict) -> tuple[YarnScaling | None, dict]:
    kw = {}
    params = raw.get("rope_parameters")
    yarn = None
    if isinstance(params, dict) and isinstance(params.get("compress"), dict):
        main, comp = params.get("main") or {}, params["compress"]
        if "rope_theta" in main:
            kw["rope_theta"] = float(main["rope_theta"])
        if "rope_theta" in comp:
            kw["compress_rope_theta"] = float(comp["rope_theta"])
        if comp.get("rope_type") == "yarn":
            yarn = comp
    elif isinstance(params, dict) and params.get("rope_type", params.get("type")) == "yarn":
        yarn = params
    if raw.get("rope_scaling"):
        yarn = raw["rope_scaling"]
    if yarn_inference.get("factor", 1) not in (None, 1, 1.0) and yarn is None:
        yarn = yarn_inference
    if yarn is None:
        return None, kw
    try:
        return YarnScaling(factor=float(yarn["factor"]),
                           original_max_position_embeddings=int(yarn["original_max_position_embeddings"]),
                           beta_fast=float(yarn.get("beta_fast") or 32), beta_slow=float(yarn.get("beta_slow") or 1)), kw
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"rope scaling (YaRN) entry is malformed: missing or bad {err}") from None


def _parse_quant(raw: dict) -> WeightQuant | None:
    qc = raw.get("quantization_config")
    if not qc:
        return None
    block = tuple(qc.get("weight_block_size", (128, 128)))
    scale_fmt = qc.get("scale_fmt") or raw.get("scale_fmt") or "float32"
    expert = qc.get("expert_dtype") or raw.get("expert_dtype") or "fp8"
    if scale_fmt not in ("ue8m0", "float32") or expert not in ("fp4", "fp8") or len(block) != 2:
        raise ConfigError(f"quantization_config is not supported: scale_fmt={scale_fmt!r}, "
                          f"expert_dtype={expert!r}, weight_block_size={list(block)}")
    return WeightQuant(weight_block_size=(int(block[0]), int(block[1])), scale_fmt=scale_fmt, expert_dtype=expert)


def validate(cfg: DeepseekV4Config) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(f"inconsistent deepseek_v4 config: {msg}")
    need(cfg.num_hidden_layers >= 1, "num_hidden_layers must be >= 1")
    need(cfg.head_dim % 2 == 0 and 0 < cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0,
         f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and within head_dim={cfg.head_dim}")
    need(cfg.num_attention_heads % cfg.o_groups == 0,
         f"num_attention_heads={cfg.num_attention_heads} is not divisible by o_groups={cfg.o_groups}")
    need(1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts,
         f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..n_routed_experts={cfg.n_routed_experts}")
    need(cfg.scoring_func in ("sqrtsoftplus", "sigmoid", "softmax"), f"unknown scoring_func {cfg.scoring_func!r}")
    need(cfg.sliding_window >= 1, "sliding_window must be >= 1")
    rates = dict(cfg.compress_rates)
    need(rates.get(CSA, 4) >= 1 and rates.get(HCA, 128) >= 1, f"compress rates must be >= 1: {rates}")
    need(cfg.hc_mult >= 1 and cfg.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1")
    need(cfg.vocab_size >= 2, "vocab_size must be >= 2")
    need(0 <= cfg.bos_token_id < cfg.vocab_size and 0 <= cfg.eos_token_id < cfg.vocab_size,
         "bos/eos token ids must be inside the vocabulary")
