"""DeepSeek-V4.1 (Flash) text-model config: one typed dataclass, canonical names are transformers'.

The released checkpoint's config.json is composite (`deepseek_v41` with a `text_config` and a
`vision_config`); a bare text config (`deepseek_v41_text`) carries the same keys at the top level.
Only the text model is built; the vision config is recorded (`has_vision`) and otherwise ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import ConfigError
from .engram_layout import engram_prime_layout, engram_table_rows
from .common import (IGNORED_KEYS, INFERENCE_ALIASES, INFERENCE_YARN_KEYS, WeightQuant, YarnScaling, as_int,
                     check_types, parse_quant, parse_rope)

# Per-layer attention kinds derived from the schedule (see DeepseekV41Config.layer_kind).
SLIDING_ONLY = "sliding"            # ratio 0: own window only
KV_SOURCE = "kv_source"             # owns a compressor, publishes compressed KV + index keys
INDEX_SOURCE = "index_source"       # reindexes the group's keys with its own query weights
REUSE = "reuse"                     # reads the group's compressed KV and the latest top-k


@dataclass(frozen=True)
class DeepseekV41Config:
    TRANSFORMERS_CLASS: ClassVar[str | None] = None    # only transformers main has deepseek_v41 (no release)
    DRAFT_METHOD: ClassVar[str] = "dspark"                     # the DSpark stages draft one block per pass
    EXPERT_STORAGES: ClassVar[tuple[str, ...]] = ("dense", "fp4")   # fp4: experts kept packed as stored
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None     # YaRN on the compress rope only (no mscale)
    max_position_embeddings: int = 1048576
    # ---- sliding window + CSA2 ----
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = ()       # backbone layers only: 0 sliding, 1 full-res, r>1 pooled
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int = -1         # < 0: no two-level top-k
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    # ---- MoE ----
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # ---- mHC ----
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # ---- Engram ----
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    # ---- DSpark draft stages ----
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # ---- misc ----
    rms_norm_eps: float = 1e-20
    bos_token_id: int = 0
    eos_token_id: int = 1
    tie_word_embeddings: bool = False
    image_token_id: int = 129264
    has_vision: bool = False                    # a vision_config was present (tower not built)
    quant: WeightQuant | None = None
    torch_dtype: str = "bfloat16"
    model_type: str = field(default="deepseek_v41", init=False)

    # ---- derived schedule ----
    def layer_kind(self, layer: int) -> str:
        if self.compress_ratios[layer] == 0:
            return SLIDING_ONLY
        if layer in self.kv_source_layer_ids:
            return KV_SOURCE
        if layer in self.index_source_layer_ids:
            return INDEX_SOURCE
        return REUSE

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source whose compressed entries `layer` attends to (latest at or before it)."""
        before = [s for s in self.kv_source_layer_ids if s <= layer]
        return before[-1] if before and self.compress_ratios[layer] else None

    @property
    def truncation_start(self) -> int:
        """First layer from which prefill may run on a shrinking suffix (YOCO): the last KV source.
        Every later layer only mixes positions through its own window."""
        return max(self.kv_source_layer_ids, default=0)

    # ---- writers (bodies below the class) ----
    def to_hf_dict(self) -> dict:
        """transformers' composite spelling (`deepseek_v41` with a `deepseek_v41_text` text_config)."""
        return _hf_dict(self)

    def to_deepseek_dict(self) -> dict:
        """The released config.json spelling (composite; engram_pad_token_id, rope_scaling, MTP ratio zeros)."""
        return _deepseek_dict(self)

    def attention_layout(self) -> list[dict]:
        """Per layer, as DeepseekV4Config.attention_layout: a layer with ratio > 0 attends to its group's top-k;
        index sources score the group's entries, inside the candidate blocks after the candidate source."""
        out = []
        for layer in range(self.num_hidden_layers):
            r = self.compress_ratios[layer]
            inside = 0 <= self.candidate_source_layer_id < layer
            out.append({"window": self.sliding_window, "ratio": r, "topk": self.index_topk if r else None,
                        "indexer": layer in self.index_source_layer_ids and r > 0,
                        "scored_limit": self.candidate_topk_blocks * self.candidate_block_size if inside else None})
        return out

    def config_hash(self) -> str:
        blob = json.dumps(self.to_hf_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# ============================================================================ schedule defaults (transformers')

RELEASED_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
RELEASED_KV_SOURCES = (2, 8, 14, 20)
RELEASED_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)
SHARED_COMPRESSED, SLIDING_ATTENTION = "shared_compressed_attention", "sliding_attention"   # HF layer_types


def default_compress_ratios(n: int) -> tuple[int, ...]:
    """The released schedule at 40 layers; otherwise 2 sliding layers, a ratio-2 half (rounded up), a ratio-1 rest."""
    if n == len(RELEASED_COMPRESS_RATIOS):
        return RELEASED_COMPRESS_RATIOS
    n_slide = min(2, n)
    n_enc = max(0, (n - n_slide + 1) // 2)
    return (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)


def default_kv_sources(ratios: tuple[int, ...]) -> tuple[int, ...]:
    """The released sources when the ratios are a prefix of the released schedule (as transformers does, even when
    that puts sources past the last layer), else the first layer of each run of equal ratios > 0."""
    if tuple(ratios) == RELEASED_COMPRESS_RATIOS[:len(ratios)]:
        return RELEASED_KV_SOURCES
    return tuple(i for i, r in enumerate(ratios) if r > 0 and (i == 0 or ratios[i - 1] != r))


def default_index_sources(kv_sources: tuple[int, ...]) -> tuple[int, ...]:
    return RELEASED_INDEX_SOURCES if tuple(kv_sources) == RELEASED_KV_SOURCES else tuple(kv_sources)


def default_dspark_targets(n: int, kv_sources: tuple[int, ...]) -> tuple[int, ...]:
    """The last three layers that are not KV sources (fewer when fewer exist)."""
    return tuple(sorted(i for i in range(n) if i not in kv_sources)[-3:])


# ============================================================================ parsing

# DeepSeek's spellings (release config.json, inference/config.json ModelArgs) and transformers' attribute_map,
# each mapped to the canonical (transformers class) name. docs/model-v41-config.md says where each was seen.
_ALIASES = {
    **INFERENCE_ALIASES,
    "kv_source_layers": "kv_source_layer_ids",
    "index_source_layers": "index_source_layer_ids",
    "candidate_source_layer": "candidate_source_layer_id",
    "engram_pad_token_id": "engram_pad_id",
    "dspark_n_activated_experts": "dspark_num_experts_per_tok",
    "num_local_experts": "n_routed_experts",
    "intermediate_size": "moe_intermediate_size",
}
# Keys without a field because V4.1 has exactly one value for them: any other value is refused, not ignored.
_FIXED = {"num_key_value_heads": 1, "attention_bias": False, "hidden_act": "silu", "topk_method": "noaux_tc",
          "num_hash_layers": 0}
_SCHEDULE = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
             "dspark_target_layer_ids", "engram_layer_ids", "engram_num_embeddings")
_NOT_JSON = {"quant", "has_vision", "model_type"}
_FIELDS = {f.name for f in dataclasses.fields(DeepseekV41Config)} - _NOT_JSON
_SCALARS = _FIELDS - set(_SCHEDULE) - {"rope_scaling"}
_ACCEPTED = (_FIELDS | set(_FIXED) | IGNORED_KEYS
             | {"rope_parameters", "layer_types", "quantization_config", "scale_fmt", "expert_dtype"})
_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text", None)


def _bad(msg: str) -> ConfigError:
    return ConfigError(f"inconsistent deepseek_v41 config: {msg}")


def parse_deepseek_v41(raw: dict) -> DeepseekV41Config:
    """Read a composite `deepseek_v41`, a bare `deepseek_v41_text`, or DeepSeek's own config dict; raise ConfigError
    with one clear line."""
    try:
        return _parse(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as err:
        raise ConfigError(f"config.json is malformed ({type(err).__name__}: {err}); "
                          f"check the deepseek_v41 keys and their types") from None


def _parse(raw: dict) -> DeepseekV41Config:
    flat, has_vision = _flatten(raw)
    fp8_marker = _take_dtype(flat)
    for old, new in _ALIASES.items():
        if old in flat:
            _merge(flat, old, new, flat.pop(old))
    yarn_inference = {new: flat.pop(old) for old, new in INFERENCE_YARN_KEYS.items() if old in flat}
    _check_keys(flat)
    kw = {k: v for k, v in flat.items() if k in _SCALARS and v is not None}   # null means "the default"
    check_types(kw, DeepseekV41Config)
    n = kw.get("num_hidden_layers", DeepseekV41Config.num_hidden_layers)
    n_nextn = kw.get("num_nextn_predict_layers", DeepseekV41Config.num_nextn_predict_layers)
    if n < 1 or n_nextn < 0:
        raise _bad(f"num_hidden_layers={n} must be >= 1 and num_nextn_predict_layers={n_nextn} >= 0")
    schedule = _schedule(flat, n, n_nextn)
    schedule.update(_engram(flat, kw))
    rope_scaling = _rope(flat, yarn_inference, kw)
    quant = _quant(flat, fp8_marker)
    try:
        cfg = DeepseekV41Config(**kw, **schedule, rope_scaling=rope_scaling, quant=quant, has_vision=has_vision)
    except TypeError as err:
        raise ConfigError(f"config.json is malformed: {err}") from None
    validate(cfg)
    return cfg


def _flatten(raw: dict) -> tuple[dict, bool]:
    """One flat dict of text keys (a composite's top-level keys merged into its text_config) and has_vision."""
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    root = dict(raw)
    vision = root.pop("vision_config", None)
    if vision is not None and not isinstance(vision, dict):
        raise ConfigError(f"config.json: vision_config must be an object, got {vision!r}")
    text = root.pop("text_config", None)
    _check_model_type(root.pop("model_type", None))
    _first_eos(root)
    if text is None:
        flat = root
    elif not isinstance(text, dict):
        raise ConfigError(f"config.json: text_config must be an object, got {text!r}")
    else:
        flat = dict(text)
        _check_model_type(flat.pop("model_type", None))
        _first_eos(flat)
        for key, value in root.items():
            if value is None:
                continue
            if flat.get(key) is not None and flat[key] != value:
                raise ConfigError(f"config.json gives {key}={value!r} at the top level but {flat[key]!r} in "
                                  f"text_config; keep one")
            flat[key] = value
    # DeepSeek's inference/config.json spells the vision tower as vision_* keys; only its presence matters here.
    n_vision = flat.get("vision_n_layers")
    for key in [k for k in flat if k.startswith("vision_")]:
        flat.pop(key)
    return flat, vision is not None or (isinstance(n_vision, int) and n_vision > 0)


def _first_eos(d: dict) -> None:
    if isinstance(d.get("eos_token_id"), list) and d["eos_token_id"]:
        d["eos_token_id"] = d["eos_token_id"][0]


def _check_model_type(model_type) -> None:
    if model_type not in _MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not a deepseek_v41 config; "
                          f"expected 'deepseek_v41' or 'deepseek_v41_text'")


def _merge(flat: dict, old: str, new: str, value) -> None:
    """Move `old`'s value to `new`; both given and different is a conflict."""
    if value is None:
        return
    if flat.get(new) is not None and flat[new] != value:
        raise ConfigError(f"config.json gives both {old}={value!r} and {new}={flat[new]!r}; keep one")
    flat[new] = value


def _take_dtype(flat: dict) -> bool:
    """`dtype` is the compute dtype in transformers' spelling and "fp8" (quantized weights) in DeepSeek's ModelArgs."""
    dtype = flat.pop("dtype", None)
    if dtype == "fp8":
        return True
    _merge(flat, "dtype", "torch_dtype", dtype)
    return False


def _check_keys(flat: dict) -> None:
    for key, want in _FIXED.items():
        if flat.get(key) is not None and flat[key] != want:
            raise ConfigError(f"config.json: {key}={flat[key]!r} is not supported; deepseek_v41 has {key}={want!r}")
    unknown = sorted(k for k in flat if k not in _ACCEPTED)
    if unknown:
        raise ConfigError(f"config.json has keys deepinfer does not know for deepseek_v41: {unknown}; "
                          f"remove them or check the model_type")


def _int_list(flat: dict, key: str) -> tuple[int, ...] | None:
    v = flat.get(key)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
        raise ConfigError(f"config.json: {key} must be a list of integers, got {v!r}")
    return tuple(v)


def _schedule(flat: dict, n: int, n_nextn: int) -> dict:
    """The per-layer schedule, with absent keys derived exactly as transformers' __post_init__ does."""
    ratios = _int_list(flat, "compress_ratios")
    if ratios is None:
        ratios = default_compress_ratios(n)
    elif not n <= len(ratios) <= n + n_nextn:
        raise _bad(f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n} "
                   f"(+ up to {n_nextn} DSpark entries)")
    elif any(ratios[n:]):
        raise _bad(f"compress_ratios gives the DSpark draft layers {list(ratios[n:])}; they must be 0 (sliding only)")
    ratios = ratios[:n]
    kv = _int_list(flat, "kv_source_layer_ids")
    kv = default_kv_sources(ratios) if kv is None else kv
    index = _int_list(flat, "index_source_layer_ids")
    dspark = _int_list(flat, "dspark_target_layer_ids")
    if flat.get("candidate_source_layer_id") is None:
        candidate = kv[-1] if kv else -1
    else:
        candidate = max(as_int(flat, "candidate_source_layer_id"), -1)   # any negative id disables it
    layer_types = flat.get("layer_types")
    if layer_types is not None and list(layer_types) != [SHARED_COMPRESSED if i in kv else SLIDING_ATTENTION
                                                         for i in range(n)]:
        raise ConfigError("config.json: layer_types disagrees with kv_source_layer_ids (a layer is "
                          f"{SHARED_COMPRESSED} exactly when it is a KV source); keep one")
    return dict(compress_ratios=ratios, kv_source_layer_ids=kv,
                index_source_layer_ids=default_index_sources(kv) if index is None else index,
                candidate_source_layer_id=candidate,
                dspark_target_layer_ids=default_dspark_targets(n, kv) if dspark is None else dspark)


def _engram(flat: dict, kw: dict) -> dict:
    layers = _int_list(flat, "engram_layer_ids") or ()
    rows = _int_list(flat, "engram_num_embeddings")
    if rows is None:
        # transformers fills zeros here, which no table lookup survives; the real row counts follow from the primes.
        get = lambda key: kw.get(key, getattr(DeepseekV41Config, key))  # noqa: E731
        rows = engram_table_rows(get("engram_vocab_size"), len(layers), get("engram_max_ngram_size"),
                                 get("engram_n_heads")) if layers else ()
    return dict(engram_layer_ids=layers, engram_num_embeddings=rows)


def _rope_type(d: dict, default: str) -> str:
    return d.get("rope_type", d.get("type", default))


def _rope(flat: dict, yarn_inference: dict, kw: dict) -> YarnScaling | None:
    """The compress rope's YaRN, from whichever of rope_parameters / rope_scaling / rope_factor... are given (they
    must agree); rope_parameters' thetas must agree with rope_theta / compress_rope_theta."""
    found = {}
    params = flat.get("rope_parameters")
    if params is not None:
        found["rope_parameters"], thetas = parse_rope({"rope_parameters": params}, {})
        _check_rope_parameters(params, kw)
        for key, theta in thetas.items():
            if key in kw and kw[key] != theta:
                raise ConfigError(f"config.json gives both {key}={kw[key]!r} and rope_parameters rope_theta="
                                  f"{theta!r}; keep one")
            kw[key] = theta
    scaling = flat.get("rope_scaling")
    if isinstance(scaling, dict) and _rope_type(scaling, "yarn") == "default":
        found["rope_scaling"] = None
    elif scaling is not None:
        found["rope_scaling"] = parse_rope({"rope_scaling": scaling}, {})[0]
        _check_attention_factor(scaling, "rope_scaling")
    if "factor" in yarn_inference:
        off = yarn_inference.get("original_max_position_embeddings") == 0   # ModelArgs: YaRN only when > 0
        found["rope_factor/original_seq_len"] = None if off else parse_rope({}, yarn_inference)[0]
    values = list(found.values())
    if any(v != values[0] for v in values):
        raise ConfigError(f"config.json gives the compress rope's YaRN scaling in {sorted(found)} and they "
                          f"disagree; keep one")
    return values[0] if values else None


def _check_attention_factor(d: dict, where: str) -> None:
    if d.get("attention_factor") not in (None, 1, 1.0):
        raise ConfigError(f"config.json: {where}.attention_factor={d['attention_factor']!r} is not supported; "
                          f"deepseek_v41 applies no YaRN mscale (attention_factor 1.0)")


def _check_rope_parameters(params: dict, kw: dict) -> None:
    head = kw.get("head_dim", DeepseekV41Config.head_dim)
    rope = kw.get("qk_rope_head_dim", DeepseekV41Config.qk_rope_head_dim)
    split = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    subs = {"main": params["main"], "compress": params["compress"]} if split else {"compress": params}
    if split and _rope_type(subs["main"], "default") != "default":
        raise ConfigError("config.json: rope_parameters.main must be the default rope; "
                          "YaRN applies to the compress rope only")
    _check_attention_factor(subs["compress"], "rope_parameters")
    for name, sub in subs.items():
        factor = sub.get("partial_rotary_factor")
        if factor is not None and abs(float(factor) * head - rope) > 1e-6:
            raise ConfigError(f"config.json: rope_parameters {name} partial_rotary_factor={factor} disagrees with "
                              f"qk_rope_head_dim={rope} / head_dim={head}; keep one")


def _quant(flat: dict, fp8_marker: bool) -> WeightQuant | None:
    """quantization_config (top level or text_config), or DeepSeek's ModelArgs dtype="fp8" + expert_dtype.
    Unstated V4.1 defaults: blocks of 32x32 with ue8m0 scales (the release); experts as dense (fp8)."""
    qc = flat.get("quantization_config")
    if not qc and not fp8_marker:
        return None
    if qc and not isinstance(qc, dict):
        raise ConfigError(f"config.json: quantization_config must be an object, got {qc!r}")
    qc = {k: v for k, v in (qc or {}).items() if v is not None}
    if qc.get("quant_method", "fp8") != "fp8":
        raise ConfigError(f"quantization_config.quant_method={qc['quant_method']!r} is not supported; "
                          f"deepseek_v41 checkpoints use 'fp8'")
    for key in ("scale_fmt", "expert_dtype"):
        if flat.get(key) is not None and key in qc and qc[key] != flat[key]:
            raise ConfigError(f"config.json gives {key}={flat[key]!r} and quantization_config.{key}={qc[key]!r}; "
                              f"keep one")
    defaults = {"weight_block_size": [32, 32], "scale_fmt": flat.get("scale_fmt") or "ue8m0",
                "expert_dtype": flat.get("expert_dtype") or "fp8"}
    return parse_quant({"quantization_config": defaults | qc})


# ============================================================================ validation

_AT_LEAST_ONE = ("vocab_size", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
                 "o_lora_rank", "max_position_embeddings", "sliding_window", "candidate_topk_blocks",
                 "candidate_block_size", "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size",
                 "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "engram_vocab_size",
                 "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size", "dspark_block_size",
                 "dspark_markov_rank", "dspark_n_routed_experts", "dspark_num_experts_per_tok")
_IN_VOCAB = ("bos_token_id", "eos_token_id", "engram_pad_id", "dspark_noise_token_id", "image_token_id")
_SCORING = ("sqrtsoftplus", "sigmoid", "softmax")


def validate(cfg: DeepseekV41Config) -> None:
    """Raise ConfigError (one line) when the config cannot describe a working model."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise _bad(msg)
    need(cfg.num_hidden_layers >= 1, f"num_hidden_layers={cfg.num_hidden_layers} must be >= 1")
    _validate_dims(cfg, need)
    _validate_sources(cfg, need)
    _validate_engram_dspark(cfg, need)
    for name in _IN_VOCAB:
        v = getattr(cfg, name)
        need(0 <= v < cfg.vocab_size, f"{name}={v} is outside the vocabulary 0..{cfg.vocab_size - 1}")


def _validate_dims(cfg: DeepseekV41Config, need) -> None:
    for name in _AT_LEAST_ONE:
        need(getattr(cfg, name) >= 1, f"{name}={getattr(cfg, name)} must be >= 1")
    need(cfg.n_shared_experts >= 0, f"n_shared_experts={cfg.n_shared_experts} must be >= 0")
    need(cfg.num_nextn_predict_layers >= 0, f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} must be >= 0")
    need(cfg.head_dim % 2 == 0, f"head_dim={cfg.head_dim} must be even")
    need(cfg.qk_rope_head_dim % 2 == 0 and 0 < cfg.qk_rope_head_dim <= cfg.head_dim,
         f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even and within head_dim={cfg.head_dim}")
    need(cfg.num_attention_heads % cfg.o_groups == 0,
         f"num_attention_heads={cfg.num_attention_heads} is not divisible by o_groups={cfg.o_groups}")
    need(cfg.head_dim % 32 == 0, f"head_dim={cfg.head_dim} must be a multiple of 32 (the window K=V latent is "
         f"FP8 in blocks of 32, the compressed entries FP4 in blocks of 16)")
    need(cfg.index_head_dim % 32 == 0 and cfg.qk_rope_head_dim <= cfg.index_head_dim,
         f"index_head_dim={cfg.index_head_dim} must be a multiple of 32 (FP4 blocks of 32) and hold the "
         f"qk_rope_head_dim={cfg.qk_rope_head_dim} RoPE channels")
    need(cfg.num_experts_per_tok <= cfg.n_routed_experts,
         f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds n_routed_experts={cfg.n_routed_experts}")
    need(cfg.dspark_num_experts_per_tok <= cfg.dspark_n_routed_experts,
         f"dspark_num_experts_per_tok={cfg.dspark_num_experts_per_tok} exceeds "
         f"dspark_n_routed_experts={cfg.dspark_n_routed_experts}")
    need(cfg.scoring_func in _SCORING, f"unknown scoring_func {cfg.scoring_func!r}; known: {list(_SCORING)}")
    for name in ("rms_norm_eps", "gate_temp", "hc_eps"):
        need(getattr(cfg, name) > 0, f"{name}={getattr(cfg, name)} must be > 0")
    need(cfg.engram_max_ngram_size >= 2, f"engram_max_ngram_size={cfg.engram_max_ngram_size} must be >= 2")


def _validate_layer_ids(name: str, ids: tuple[int, ...], n: int, need) -> None:
    need(all(0 <= i < n for i in ids), f"{name} {list(ids)} has layers outside 0..{n - 1}")
    need(list(ids) == sorted(set(ids)), f"{name} {list(ids)} must be strictly increasing")


def _validate_sources(cfg: DeepseekV41Config, need) -> None:
    n, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    kv, index = cfg.kv_source_layer_ids, cfg.index_source_layer_ids
    need(len(ratios) == n, f"compress_ratios has {len(ratios)} entries but num_hidden_layers is {n}")
    need(all(r >= 0 for r in ratios), f"compress_ratios {list(ratios)} must all be >= 0")
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        _validate_layer_ids(name, ids, n, need)
        zero = [i for i in ids if ratios[i] == 0]
        need(not zero, f"{name} {list(ids)} includes layers {zero} whose compress_ratio is 0")
    early = [i for i in index if not kv or i < kv[0]]
    need(not early, f"index sources {early} come before any KV source (nothing publishes their index keys)")
    orphans = [i for i in range(n) if ratios[i] > 0 and not any(s <= i for s in kv)]
    need(not orphans, f"layers {orphans} have compress_ratio > 0 but no KV source at or before them")
    for i in range(n):
        s = cfg.kv_source_of(i)
        need(s is None or ratios[i] == ratios[s], f"layer {i} (compress_ratio {ratios[i]}) reads KV source {s} "
             f"(compress_ratio {ratios[s] if s is not None else 0}); a group must share its source's ratio")
    lone = [s for s in kv if s not in index]
    need(not lone, f"KV sources {lone} are not index sources; their group would read another group's top-k")
    c = cfg.candidate_source_layer_id
    need(c < 0 or c in index, f"candidate_source_layer_id={c} is not among index_source_layer_ids {list(index)}")
    later = [s for s in kv if c >= 0 and s > c]
    need(not later, f"KV sources {later} come after candidate_source_layer_id={c}; its candidate blocks index "
         f"its own group's entries, so it must be in the last group")


def _validate_engram_dspark(cfg: DeepseekV41Config, need) -> None:
    n = cfg.num_hidden_layers
    _validate_layer_ids("engram_layer_ids", cfg.engram_layer_ids, n, need)
    rows = cfg.engram_num_embeddings
    need(len(rows) == len(cfg.engram_layer_ids), f"engram_num_embeddings has {len(rows)} entries but "
         f"engram_layer_ids has {len(cfg.engram_layer_ids)}")
    need(all(r >= 1 for r in rows), f"engram_num_embeddings {list(rows)} must all be >= 1")
    targets = cfg.dspark_target_layer_ids
    need(all(0 <= t < n for t in targets), f"dspark_target_layer_ids {list(targets)} has layers outside 0..{n - 1}")
    need(list(targets) == sorted(set(targets)), f"dspark_target_layer_ids {list(targets)} must be strictly "
         f"increasing (the features concatenate in layer order)")
    need(not cfg.num_nextn_predict_layers or targets, f"num_nextn_predict_layers={cfg.num_nextn_predict_layers} "
         f"DSpark stages need dspark_target_layer_ids (the layers whose streams feed them)")


# ============================================================================ writers

_NOT_TEXT = {"rope_scaling", "quant", "has_vision", "image_token_id", "model_type", "torch_dtype"}


def _text_dict(cfg: DeepseekV41Config) -> dict:
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in _NOT_TEXT}
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
    d["compress_ratios"] = list(cfg.compress_ratios) + [0] * cfg.num_nextn_predict_layers
    return d


def _yarn_dict(y: YarnScaling) -> dict:
    return {"rope_type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
            "original_max_position_embeddings": y.original_max_position_embeddings}


def _root_dict(cfg: DeepseekV41Config, text: dict) -> dict:
    d = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": cfg.torch_dtype,
         "image_token_id": cfg.image_token_id}
    if cfg.quant is not None:
        q = cfg.quant
        d["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": list(q.weight_block_size), "scale_fmt": q.scale_fmt,
                                    "expert_dtype": q.expert_dtype}
    d["text_config"] = text
    if cfg.has_vision:
        d["vision_config"] = {"model_type": "deepseek_v41_vision"}   # transformers' defaults are the release's
    return d


def _hf_dict(cfg: DeepseekV41Config) -> dict:
    text = _text_dict(cfg)
    partial = cfg.qk_rope_head_dim / cfg.head_dim
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta, "partial_rotary_factor": partial}
    if cfg.rope_scaling is not None:
        text["rope_scaling"] = _yarn_dict(cfg.rope_scaling)
        compress.update(_yarn_dict(cfg.rope_scaling), attention_factor=1.0)
    text.update(model_type="deepseek_v41_text", layer_types=[
        SHARED_COMPRESSED if i in cfg.kv_source_layer_ids else SLIDING_ATTENTION for i in range(cfg.num_hidden_layers)])
    text["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                        "partial_rotary_factor": partial}, "compress": compress}
    return _root_dict(cfg, text) | {"tie_word_embeddings": cfg.tie_word_embeddings}


def _deepseek_dict(cfg: DeepseekV41Config) -> dict:
    text = _text_dict(cfg)
    ids = {"bos_token_id": text.pop("bos_token_id"), "eos_token_id": text.pop("eos_token_id")}
    text["engram_pad_token_id"] = text.pop("engram_pad_id")
    text.update(model_type="deepseek_v41_text", num_key_value_heads=1, topk_method="noaux_tc")
    if cfg.rope_scaling is not None:
        text["rope_scaling"] = _yarn_dict(cfg.rope_scaling)
    return _root_dict(cfg, text) | ids
