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
from typing import ClassVar

from ..errors import ConfigError
from .common import (IGNORED_KEYS, INFERENCE_ALIASES, INFERENCE_YARN_KEYS, WeightQuant, YarnScaling, as_int,
                     check_types, parse_quant, parse_rope)

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"


@dataclass(frozen=True)
class DeepseekV4Config:
    # the released transformers class that runs this family (transformers==5.23.0): the harness's side-by-side
    TRANSFORMERS_CLASS: ClassVar[str | None] = "DeepseekV4ForCausalLM"
    DRAFT_METHOD: ClassVar[str] = "mtp"                        # the NextN layer drafts one token per pass
    EXPERT_STORAGES: ClassVar[tuple[str, ...]] = ("dense",)    # build_model's expert_storage choices
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

    def attention_layout(self) -> list[dict]:
        """Per layer, for cost models (deepinfer-bench step): window, compress ratio (0: window only), top-k of the
        compressed entries attended (None: every visible entry), whether an indexer scores them, and how many it
        may score (None: every visible entry)."""
        rates = dict(self.compress_rates)
        return [{"window": self.sliding_window, "ratio": rates.get(kind, 0),
                 "topk": self.index_topk if kind == CSA else None, "indexer": kind == CSA, "scored_limit": None}
                for kind in self.layer_types]

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
    try:
        return _parse(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # a value of the wrong kind somewhere
        raise ConfigError(f"config.json is malformed ({type(err).__name__}: {err}); "
                          f"check the deepseek_v4 keys and their types") from None


def _parse(raw: dict) -> DeepseekV4Config:
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    raw = dict(raw)
    for old, new in INFERENCE_ALIASES.items():
        if old in raw:
            value = raw.pop(old)
            if new in raw and raw[new] != value:
                raise ConfigError(f"config.json gives both {old}={value!r} and {new}={raw[new]!r}; keep one")
            raw.setdefault(new, value)
    yarn_inference = {new: raw.pop(old) for old, new in INFERENCE_YARN_KEYS.items() if old in raw}

    known = {f.name for f in dataclasses.fields(DeepseekV4Config)}
    legacy = {"compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "rope_parameters",
              "partial_rotary_factor", "compress_rate_csa", "compress_rate_hca"}
    unknown = sorted(k for k in raw if k not in known | legacy | IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json has keys deepinfer does not know for deepseek_v4: {unknown}; "
                          f"remove them or check the model_type")
    explicit = {"model_type", "layer_types", "mlp_layer_types", "compress_rates", "qk_rope_head_dim",
                "rope_scaling", "quant"}
    kw = {k: v for k, v in raw.items() if k in known and k not in explicit}
    if isinstance(kw.get("eos_token_id"), list) and kw["eos_token_id"]:
        kw["eos_token_id"] = kw["eos_token_id"][0]
    kw = {k: v for k, v in kw.items() if v is not None}   # null means "the default"
    check_types(kw, DeepseekV4Config)
    n = as_int(raw, "num_hidden_layers", DeepseekV4Config.num_hidden_layers)
    n_mtp = as_int(raw, "num_nextn_predict_layers", DeepseekV4Config.num_nextn_predict_layers)
    if n < 1 or n_mtp < 0:
        raise ConfigError(f"config.json: num_hidden_layers={n} must be >= 1 and "
                          f"num_nextn_predict_layers={n_mtp} >= 0")

    layer_types, mlp_types, rates = _schedule(raw, n, n_mtp)
    rope_dim = _rope_dim(raw)
    rope_scaling, kw_rope = parse_rope(raw, yarn_inference)
    kw.update(kw_rope)
    quant = parse_quant(raw)
    try:
        cfg = DeepseekV4Config(**kw, layer_types=tuple(layer_types), mlp_layer_types=tuple(mlp_types),
                               compress_rates=tuple(sorted(rates.items())), qk_rope_head_dim=rope_dim,
                               rope_scaling=rope_scaling, quant=quant)
    except TypeError as err:
        raise ConfigError(f"config.json is malformed: {err}") from None
    validate(cfg)
    return cfg


def _schedule(raw: dict, n: int, n_mtp: int) -> tuple[list, list, dict]:
    """(layer_types [n], mlp_layer_types [n], compress_rates {CSA: r, HCA: r}) from whichever spellings are given
    (layer_types / compress_ratios, mlp_layer_types / num_hash_layers, compress_rates / compress_rate_*)."""
    given_rates = raw.get("compress_rates")
    if given_rates is not None and not isinstance(given_rates, dict):
        raise ConfigError(f"config.json: compress_rates must be an object {{layer type: rate}}, got {given_rates!r}")
    rates = {CSA: 4, HCA: 128, **(given_rates or {})}
    if "compress_rate_csa" in raw:
        rates[CSA] = raw["compress_rate_csa"]
    if "compress_rate_hca" in raw:
        rates[HCA] = raw["compress_rate_hca"]
    bad_rates = sorted(k for k in rates if k not in (CSA, HCA))
    if bad_rates:
        raise ConfigError(f"compress_rates has unknown layer types {bad_rates}; allowed: {[CSA, HCA]}")

    from_ratios = None
    if raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        if not isinstance(ratios, list) or any(isinstance(r, bool) or not isinstance(r, int) or r < 0
                                               for r in ratios):
            raise ConfigError(f"compress_ratios must be a list of integers >= 0 (0 sliding, 4 CSA, "
                              f"else HCA), got {ratios!r}")
        if len(ratios) not in (n, n + n_mtp):
            raise ConfigError(f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n} "
                              f"(+{n_mtp} MTP): give one ratio per layer")
        hca = sorted({r for r in ratios[:n] if r not in _RATIO_TO_TYPE})
        if len(hca) > 1:
            raise ConfigError(f"compress_ratios mixes several HCA ratios {hca}; one is supported")
        if hca:
            rates[HCA] = hca[0]
        from_ratios = [_RATIO_TO_TYPE.get(r, HCA) for r in ratios[:n]]
    if raw.get("layer_types") is not None:
        if not isinstance(raw["layer_types"], list):
            raise ConfigError(f"layer_types must be a list, got {raw['layer_types']!r}")
        layer_types = list(raw["layer_types"])
        if from_ratios is not None and from_ratios != layer_types:
            raise ConfigError("config.json gives both layer_types and compress_ratios and they disagree; keep one")
    elif from_ratios is not None:
        layer_types = from_ratios
    else:
        raise ConfigError("config.json gives neither layer_types nor compress_ratios: "
                          "the per-layer attention schedule is required")
    if len(layer_types) != n:
        raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n}")
    bad = sorted({str(t) for t in layer_types if t not in LAYER_TYPES})
    if bad:
        raise ConfigError(f"layer_types has unknown entries {bad}; allowed: {list(LAYER_TYPES)}")

    if raw.get("num_hash_layers") is not None:
        n_hash = as_int(raw, "num_hash_layers")
        if not 0 <= n_hash <= n:
            raise ConfigError(f"num_hash_layers={n_hash} is outside 0..num_hidden_layers ({n})")
    if raw.get("mlp_layer_types") is not None:
        mlp_types = raw["mlp_layer_types"]
        if not isinstance(mlp_types, list) or len(mlp_types) != n or any(t not in (HASH_MOE, MOE) for t in mlp_types):
            raise ConfigError(f"mlp_layer_types must be a list of {n} entries (num_hidden_layers), each "
                              f"'hash_moe' or 'moe'; got {mlp_types!r}")
        if raw.get("num_hash_layers") is not None and mlp_types != [HASH_MOE] * n_hash + [MOE] * (n - n_hash):
            raise ConfigError("config.json gives both mlp_layer_types and num_hash_layers and they disagree; keep one")
    else:
        n_hash = as_int(raw, "num_hash_layers", 3) if raw.get("num_hash_layers") is not None else min(3, n)
        mlp_types = [HASH_MOE] * n_hash + [MOE] * (n - n_hash)
    return layer_types, mlp_types, rates


def _rope_dim(raw: dict) -> int:
    """qk_rope_head_dim, given or as partial_rotary_factor x head_dim (default head_dim / 8)."""
    head_dim = as_int(raw, "head_dim", DeepseekV4Config.head_dim)
    from_factor = None
    if raw.get("partial_rotary_factor") is not None:
        factor = raw["partial_rotary_factor"]
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise ConfigError(f"config.json: partial_rotary_factor must be a number, got {factor!r}")
        from_factor = int(round(head_dim * float(factor)))
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = as_int(raw, "qk_rope_head_dim")
        if from_factor is not None and from_factor != rope_dim:
            raise ConfigError(f"config.json: qk_rope_head_dim={rope_dim} disagrees with partial_rotary_factor="
                              f"{raw['partial_rotary_factor']} x head_dim={head_dim}; keep one")
    elif from_factor is not None:
        rope_dim = from_factor
    else:
        rope_dim = head_dim // 8
    return rope_dim


def validate(cfg: DeepseekV4Config) -> None:
    def need(ok: bool, msg: str):
        if not ok:
            raise ConfigError(f"inconsistent deepseek_v4 config: {msg}")
    need(cfg.num_hidden_layers >= 1, "num_hidden_layers must be >= 1")
    need(len(cfg.layer_types) == cfg.num_hidden_layers,
         f"layer_types has {len(cfg.layer_types)} entries but num_hidden_layers is {cfg.num_hidden_layers}")
    need(len(cfg.mlp_layer_types) == cfg.num_hidden_layers,
         f"mlp_layer_types has {len(cfg.mlp_layer_types)} entries but num_hidden_layers is {cfg.num_hidden_layers}")
    bad = sorted({str(t) for t in cfg.layer_types if t not in LAYER_TYPES})
    need(not bad, f"layer_types has unknown entries {bad}; allowed: {list(LAYER_TYPES)}")
    bad = sorted({str(t) for t in cfg.mlp_layer_types if t not in (HASH_MOE, MOE)})
    need(not bad, f"mlp_layer_types has unknown entries {bad}; allowed: {[HASH_MOE, MOE]}")
    for name in ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                 "o_lora_rank", "n_routed_experts", "moe_intermediate_size", "index_n_heads", "index_head_dim",
                 "index_topk", "max_position_embeddings"):
        need(getattr(cfg, name) >= 1, f"{name}={getattr(cfg, name)} must be >= 1")
    need(cfg.n_shared_experts >= 0 and cfg.num_nextn_predict_layers >= 0,
         "n_shared_experts and num_nextn_predict_layers must be >= 0")
    need(cfg.head_dim % 2 == 0 and 0 < cfg.qk_rope_head_dim <= cfg.head_dim and cfg.qk_rope_head_dim % 2 == 0,
         f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and within head_dim={cfg.head_dim}")
    need(cfg.num_attention_heads % cfg.o_groups == 0,
         f"num_attention_heads={cfg.num_attention_heads} is not divisible by o_groups={cfg.o_groups}")
    need(1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts,
         f"num_experts_per_tok={cfg.num_experts_per_tok} must be in 1..n_routed_experts={cfg.n_routed_experts}")
    need(cfg.scoring_func in ("sqrtsoftplus", "sigmoid", "softmax"), f"unknown scoring_func {cfg.scoring_func!r}")
    need(cfg.sliding_window >= 1, "sliding_window must be >= 1")
    rates = dict(cfg.compress_rates)
    need(set(rates) == {CSA, HCA} and all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                                          for r in rates.values()),
         f"compress_rates must give an integer rate >= 1 for {CSA} and {HCA}: {rates}")
    need(cfg.hc_mult >= 1 and cfg.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1")
    need(cfg.vocab_size >= 2, "vocab_size must be >= 2")
    need(0 <= cfg.bos_token_id < cfg.vocab_size and 0 <= cfg.eos_token_id < cfg.vocab_size,
         "bos/eos token ids must be inside the vocabulary")
