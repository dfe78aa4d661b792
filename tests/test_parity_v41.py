"""V4.1 parity against transformers' deepseek_v41 (not yet in a transformers release).

Runs when the reference is importable: a transformers with `models.deepseek_v41`, or
DEEPINFER_V41_REFERENCE=<dir of a package holding transformers main's modeling/configuration
files>. Skips otherwise (docs/testing.md says how to provide one). Results: docs/results.md.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.checkpoint.writer import hf_tensors
from deepinfer.reference import compute_logits, extend, new_state
from tests.helpers_v41 import tiny_v41_config, tiny_v41_model, tiny_v41_tokenizer


def _reference():
    try:
        return importlib.import_module("transformers.models.deepseek_v41")
    except ImportError:
        pass
    where = os.environ.get("DEEPINFER_V41_REFERENCE")
    if not where:
        pytest.skip("no deepseek_v41 reference: set DEEPINFER_V41_REFERENCE (docs/testing.md)")
    path = Path(where)
    sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.name)


def _hf_config(ref, cfg):
    y = cfg.rope_scaling
    return ref.DeepseekV41TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, sliding_window=cfg.sliding_window,
        compress_ratios=list(cfg.compress_ratios), kv_source_layer_ids=list(cfg.kv_source_layer_ids),
        index_source_layer_ids=list(cfg.index_source_layer_ids),
        candidate_source_layer_id=cfg.candidate_source_layer_id, candidate_topk_blocks=cfg.candidate_topk_blocks,
        candidate_block_size=cfg.candidate_block_size, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, engram_layer_ids=list(cfg.engram_layer_ids),
        engram_vocab_size=cfg.engram_vocab_size, engram_num_embeddings=list(cfg.engram_num_embeddings),
        engram_max_ngram_size=cfg.engram_max_ngram_size, engram_n_heads=cfg.engram_n_heads,
        engram_head_dim=cfg.engram_head_dim, engram_pad_id=cfg.engram_pad_id,
        engram_compressed_vocab_size=cfg.engram_compressed_vocab_size, num_nextn_predict_layers=0,
        dspark_target_layer_ids=list(cfg.dspark_target_layer_ids), gate_temp=cfg.gate_temp,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_scaling={"rope_type": "yarn", "factor": y.factor, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                      "original_max_position_embeddings": y.original_max_position_embeddings})


def reference_or_skip():
    return _reference()


def hf_twin(ref, model, tokenizer, dtype=torch.float32):
    """The reference model holding our model's weights, through our own transformers-format export."""
    hf = ref.DeepseekV41ForCausalLM(_hf_config(ref, model.cfg)).float().eval()
    state = {name: t for name, t in hf_tensors(model) if ".mtp." not in name}   # the reference has no DSpark
    missing, unexpected = hf.load_state_dict({k: v.float().cpu() for k, v in state.items()}, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    hf = hf.to(device=model.device, dtype=dtype)
    for name, p in hf.named_parameters():   # the release keeps these fp32 whatever the model dtype
        if name.rsplit(".", 1)[-1].startswith(("hc_", "attn_sink", "bias")):
            p.data = state[name].float().to(p.device)
    from transformers import PreTrainedTokenizerFast
    hf.model.bind_tokenizer(PreTrainedTokenizerFast(tokenizer_object=tokenizer))
    return hf


@pytest.mark.parametrize("length", [1, 9, 64, 150])
def test_logits_match_reference_fp32(length):
    ref = _reference()
    model = tiny_v41_model(torch.float32)
    hf = hf_twin(ref, model, tiny_v41_tokenizer())
    ids = torch.randint(3, model.cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
    ours = compute_logits(model, ids)
    with torch.no_grad():
        theirs = torch.stack([hf(input_ids=row[None], use_cache=True).logits[0] for row in ids])
    assert (ours - theirs).abs().max().item() < 1e-4, tiny_v41_config()


def test_decode_matches_reference_cached_path():
    """Prefill 40 tokens then decode 20 one at a time, both sides with their caches."""
    ref = _reference()
    model = tiny_v41_model(torch.float32)
    hf = hf_twin(ref, model, tiny_v41_tokenizer())
    ids = torch.randint(3, model.cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(7))
    state = new_state(model)
    ours = [extend(model, [ids[:40]], [state])[0]]
    ours += [extend(model, [ids[t:t + 1]], [state])[0] for t in range(40, 60)]
    with torch.no_grad():
        out = hf(input_ids=ids[None, :40], use_cache=True)
        theirs, cache = [out.logits[0]], out.past_key_values
        for t in range(40, 60):
            out = hf(input_ids=ids[None, t:t + 1], past_key_values=cache, use_cache=True)
            theirs.append(out.logits[0])
    assert (torch.cat(ours) - torch.cat(theirs)).abs().max().item() < 1e-4
