"""Tensor name maps between DeepSeek's checkpoint names (= our module names) and transformers' names.

DeepSeek: `layers.{i}.attn.wq_a.weight`, `layers.{i}.ffn.experts.{j}.w1.weight`, `mtp.{k}.*`, ...
Our modules stack experts as `ffn.experts.w1` [E, I, D]; the loader scatters `experts.{j}.w1.weight` into row j.

transformers, by model_type:
- deepseek_v4: a rename table, `model.layers.{i}.self_attn.q_a_proj.weight`,
  `model.layers.{i}.mlp.experts.gate_up_proj` ([E, 2I, D], w1 rows then w3 rows), `lm_head.weight`, ...
- deepseek_v41: DeepSeek's names behind a `model.` prefix, `lm_head.weight` for `head.weight`, experts per
  expert (`model.layers.{i}.ffn.experts.{j}.w1.weight`); `mtp.*` may carry the prefix or not (transformers
  ignores it either way). Vision tensors (`vision.*`, `aligner.*`, `image_{start,end,newline}`) belong to
  the image tower, which the text model does not build: the loader skips them (`is_vision_tensor`).
"""

from __future__ import annotations

import re

# DeepSeek leaf (after `layers.{i}.` or `mtp.{k}.`) -> transformers leaf (after `model.layers.{i}.`)
BLOCK_LEAVES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# Leaves only MTP layers have (our HF export keeps DeepSeek's spelling for them; transformers ignores mtp.*).
MTP_LEAVES = {
    "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
    "e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn", "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
}
GLOBALS = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
EXPERTS_HF = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

_DS_LAYER = re.compile(r"^(layers|mtp)\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^(model\.layers|mtp)\.(\d+)\.(.+)$")
_DS_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.(weight|scale)$")
_HF_TO_DS_BLOCK = {v: k for k, v in BLOCK_LEAVES.items()}
_HF_TO_DS_MTP = {v: k for k, v in MTP_LEAVES.items()}
_HF_TO_DS_GLOBAL = {v: k for k, v in GLOBALS.items()}


V41 = "deepseek_v41"
_VISION = re.compile(r"^(model\.)?(vision\.|aligner\.|image_(start|end|newline)$)")


def is_vision_tensor(name: str) -> bool:
    """A tensor of the V4.1 image tower / aligner / image-span embeddings (either spelling)."""
    return _VISION.match(name) is not None


def ds_to_hf(name: str, model_type: str = "deepseek_v4") -> str | None:
    """DeepSeek name -> transformers name; None for V4 per-expert tensors (the exporter stacks those)."""
    if model_type == V41:
        return "lm_head.weight" if name == "head.weight" else f"model.{name}"
    if name in GLOBALS:
        return GLOBALS[name]
    m = _DS_LAYER.match(name)
    if m is None:
        return None
    kind, idx, leaf = m.groups()
    prefix = "model.layers" if kind == "layers" else "mtp"
    if kind == "mtp" and leaf in MTP_LEAVES:
        return f"mtp.{idx}.{MTP_LEAVES[leaf]}"
    if leaf in BLOCK_LEAVES:
        return f"{prefix}.{idx}.{BLOCK_LEAVES[leaf]}"
    return None


# transformers (>= 5) saves with its load-time renames reversed: `model.layers.{i}.` + DeepSeek leaves,
# `head.weight`, and the main attention's kv_norm spelled `attn.norm`.
_SAVED_QUIRKS = {"attn.norm.weight": "attn.kv_norm.weight"}


def hf_to_ds(name: str, model_type: str = "deepseek_v4") -> str | None:
    """transformers name -> DeepSeek name; V4's stacked experts map to `...ffn.experts.gate_up_proj` markers."""
    if model_type == V41:
        if name == "lm_head.weight":
            return "head.weight"
        if name.startswith("model."):
            return name[len("model."):]
        return name if name.startswith("mtp.") else None
    if name in _HF_TO_DS_GLOBAL:
        return _HF_TO_DS_GLOBAL[name]
    if name == "head.weight":
        return name
    m = _HF_LAYER.match(name)
    if m is None:
        return None
    kind, idx, leaf = m.groups()
    prefix = "layers" if kind == "model.layers" else "mtp"
    if kind == "model.layers" and (leaf in BLOCK_LEAVES or leaf in _SAVED_QUIRKS or _DS_EXPERT.match(leaf)):
        return f"{prefix}.{idx}.{_SAVED_QUIRKS.get(leaf, leaf)}"
    if kind == "mtp" and leaf in _HF_TO_DS_MTP:
        return f"mtp.{idx}.{_HF_TO_DS_MTP[leaf]}"
    if leaf in _HF_TO_DS_BLOCK:
        return f"{prefix}.{idx}.{_HF_TO_DS_BLOCK[leaf]}"
    if leaf.startswith("mlp.experts.") and leaf.split(".")[-1] in EXPERTS_HF:
        return f"{prefix}.{idx}.ffn.experts.{leaf.split('.')[-1]}"
    return None


def checkpoint_tensors(model) -> dict:
    """Every tensor a checkpoint holds for `model` (parameters + persistent buffers, not rope caches),
    by module name; the live tensors, so callers can fill them."""
    return model.state_dict(keep_vars=True)


def hf_experts_prefix(ds_experts: str) -> str:
    """`layers.3.ffn.experts` -> `model.layers.3.mlp.experts` (`mtp.0.ffn.experts` -> `mtp.0.mlp.experts`)."""
    kind, idx, _ = _DS_LAYER.match(ds_experts).groups()
    return f"{'model.layers' if kind == 'layers' else 'mtp'}.{idx}.mlp.experts"


def split_expert_name(ds_name: str) -> tuple[str, int, str, str] | None:
    """`layers.3.ffn.experts.7.w1.weight` -> ("layers.3.ffn.experts", 7, "w1", "weight")."""
    m = _DS_LAYER.match(ds_name)
    if m is None:
        return None
    e = _DS_EXPERT.match(m.group(3))
    if e is None:
        return None
    return f"{m.group(1)}.{m.group(2)}.ffn.experts", int(e.group(1)), e.group(2), e.group(3)
