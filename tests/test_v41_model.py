"""V4.1 reference model: incremental state, YOCO truncation, batching, CSA2 sharing, DSpark drafting.

float64 with the QAT quantizers on: every path must agree to 1e-9. Reduction order may differ in the last
bits between paths (measured up to 1.5e-11), but the quantizers are discontinuous, so a path that computed
anything differently would flip an FP4/FP8 step or a top-k pick and miss by far more than 1e-9.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.errors import DeepInferError
from deepinfer.models import build_model
from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.reference import compute_logits, extend, extend_and_draft, new_state
from tests.helpers_v41 import tiny_v41_config, tiny_v41_model, tiny_v41_tokenizer

T = 70


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a.double() - b.double()).abs().max().item() <= 1e-9


@pytest.fixture(scope="module")
def model():
    return tiny_v41_model(torch.float64)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 512, (T,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def full(model, ids):
    return compute_logits(model, ids[None])[0]


def test_token_by_token_and_chunked_match_full(model, ids, full):
    st = new_state(model)
    steps = torch.cat([extend(model, [ids[t:t + 1]], [st])[0] for t in range(T)])
    assert same(steps, full)
    st = new_state(model)
    cuts = [0, 13, 14, 40, 41, T]
    chunked = torch.cat([extend(model, [ids[a:b]], [st])[0] for a, b in zip(cuts, cuts[1:])])
    assert same(chunked, full)


@pytest.mark.parametrize("n", [1, 6, 33, T])
def test_yoco_truncated_prefill_is_exact(model, ids, full, n):
    st = new_state(model)
    last = extend(model, [ids[:n]], [st], last_only=True)[0]
    assert same(last[0], full[n - 1])
    rest = [extend(model, [ids[t:t + 1]], [st])[0] for t in range(n, min(n + 12, T))]
    if rest:
        assert same(torch.cat(rest), full[n:n + 12])


def test_yoco_runs_each_layer_on_its_suffix(model, ids):
    """From the last KV source on, layer l's MoE sees (L-1-l)(W-1)+1 rows of a long prompt."""
    cfg = model.cfg
    seen = {}
    hooks = [b.ffn.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, args[0].shape[0]))
             for i, b in enumerate(model.layers)]
    try:
        extend(model, [ids], [new_state(model)], last_only=True)
    finally:
        for h in hooks:
            h.remove()
    L, W = cfg.num_hidden_layers, cfg.sliding_window
    for i in range(L):
        want = T if i < cfg.truncation_start else min(T, (L - 1 - i) * (W - 1) + 1)
        assert seen[i] == want, (i, seen)


def test_batched_sequences_match_single(model, ids, full):
    a, b = new_state(model), new_state(model)
    out_a, out_b = extend(model, [ids[:30], ids[:47]], [a, b])
    assert same(out_a, full[:30]) and same(out_b, full[:47])
    out_a, out_b = extend(model, [ids[30:60], ids[47:48]], [a, b], last_only=True)
    assert same(out_a[0], full[59]) and same(out_b[0], full[47])


def test_source_groups_store_their_own_entries(model, ids):
    """Compressed entries and keys live once per KV source; reuse layers keep only their window."""
    cfg = model.cfg
    st = new_state(model)
    extend(model, [ids[:T - 1]], [st])
    for i, layer in enumerate(st.layers):
        assert layer.window.shape[0] == cfg.sliding_window - 1
        if i in cfg.kv_source_layer_ids:
            ratio = cfg.compress_ratios[i]
            assert layer.compressor.entries.shape == ((T - 1) // ratio, cfg.head_dim)
            assert layer.indexer.entries.shape == ((T - 1) // ratio, cfg.index_head_dim)
            assert (layer.compressor.pending_kv is not None and layer.compressor.pending_kv.shape[0]) == \
                ((T - 1) % ratio if ratio > 1 else 0)
        else:
            assert layer.compressor is None and layer.indexer is None


def test_second_source_replaces_first_groups_entries(ids):
    """Zeroing source 2's compressor output changes layers 2-3 but not what source 4's group attends:
    with layers >= 4 fed identical inputs, their compressed branch must not see group-2 entries."""
    cfg = tiny_v41_config()
    model = tiny_v41_model(torch.float64)
    st = new_state(model)
    extend(model, [ids[:40]], [st])
    g2, g4 = st.layers[2].compressor.entries, st.layers[4].compressor.entries
    assert g2.shape == g4.shape and not same(g2, g4)
    # layer 5 (reuse of source 4) reads group 4: its attention over the entries uses the group-4 tensor
    assert cfg.layer_kind(5) == "reuse" and model.cfg.kv_source_of(5) == 4


def test_engram_layers_need_a_tokenizer():
    model = build_model(tiny_v41_config(), "cpu", torch.float32)
    init_random_weights(model, 0)
    with pytest.raises(DeepInferError, match="bind its tokenizer"):
        compute_logits(model, torch.tensor([[5, 6, 7]]))


def test_state_bytes_per_token_match_the_dense_layout(model, ids):
    """Growth per token = sum over KV sources of (latent d + key dI) x element size / ratio."""
    cfg = model.cfg
    a, b = new_state(model), new_state(model)
    extend(model, [ids[:32]], [a])
    extend(model, [ids[:64]], [b])
    per_token = (b.nbytes() - a.nbytes()) / 32
    want = sum((cfg.head_dim + cfg.index_head_dim) * 8 / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)
    assert per_token == want


# ---------------------------------------------------------------- DSpark


@pytest.fixture(scope="module")
def drafter(model):
    return model


def test_draft_chunked_prefill_and_batching_agree(drafter, ids):
    one = extend_and_draft(drafter, [ids[:40]], [new_state(drafter)])
    st = new_state(drafter)
    extend_and_draft(drafter, [ids[:25]], [st])
    chunked = extend_and_draft(drafter, [ids[25:40]], [st])
    both = extend_and_draft(drafter, [ids[:40], ids[5:30]], [new_state(drafter), new_state(drafter)])
    other = extend_and_draft(drafter, [ids[5:30]], [new_state(drafter)])
    assert same(one[0], chunked[0]) and same(one[2].tokens, chunked[2].tokens)
    assert same(one[2].logits, chunked[2].logits) and same(one[2].confidence, chunked[2].confidence)
    assert same(both[2].logits[0], one[2].logits[0]) and same(both[2].logits[1], other[2].logits[0])
    assert one[2].tokens.shape == (1, drafter.cfg.dspark_block_size)
    assert new_state(drafter).mtp and len(new_state(drafter).mtp) == 3


def test_draft_target_logits_match_plain_forward(drafter, ids):
    y, logits, _ = extend_and_draft(drafter, [ids[:40]], [new_state(drafter)])
    plain = compute_logits(drafter, ids[None, :40])[0, -1]
    assert same(logits[0], plain) and int(y) == int(plain.argmax())


def test_markov_bias_is_applied_left_to_right(drafter, ids):
    """Draft logits minus the Markov bias of the previous token are the same whatever the bias is."""
    last = drafter.mtp[-1]
    st = new_state(drafter)
    y, _, with_bias = extend_and_draft(drafter, [ids[:40]], [st])
    saved = last.markov_head.head.weight.clone()
    try:
        last.markov_head.head.weight.zero_()
        _, _, no_bias = extend_and_draft(drafter, [ids[:40]], [new_state(drafter)])
    finally:
        last.markov_head.head.weight.copy_(saved)
    prev = torch.cat([y.view(1, 1), with_bias.tokens[:, :-1]], dim=1)[0]
    bias = last.markov_head(prev)[0]                                   # [block, V]
    assert torch.allclose(with_bias.logits[0].double() - bias, no_bias.logits[0].double(), atol=1e-5)
    assert (bias.abs().amax(dim=-1) > 1e-3).all()


def test_block_has_no_causal_mask(drafter, ids):
    """The first draft position sees the noise entries after it: changing the noise token moves it."""
    st = new_state(drafter)
    _, _, a = extend_and_draft(drafter, [ids[:40]], [st])
    cfg = drafter.cfg
    drafter.dspark.cfg = dataclasses.replace(cfg, dspark_noise_token_id=cfg.dspark_noise_token_id + 1)
    try:
        _, _, b = extend_and_draft(drafter, [ids[:40]], [new_state(drafter)])
    finally:
        drafter.dspark.cfg = cfg
    assert not torch.allclose(a.logits[0, 0], b.logits[0, 0])


def test_packed_state_layout_gives_the_published_890_bytes_per_token():
    from deepinfer.reference import packed_kv_bytes_per_token
    from deepinfer.config.presets import preset_config
    assert packed_kv_bytes_per_token(preset_config("deepseek_v41", "flash")) == 890.0


def test_fp4_resident_experts_match_dense_dequantized_experts(ids):
    """expert_storage="fp4" keeps the packed e2m1 bytes + e8m0 scales and dequantizes per use."""
    from deepinfer.kernels.quant import dequantize_fp4, quantize_fp4
    dense = tiny_v41_model(torch.float32)
    packed = build_model(dense.cfg, "cpu", torch.float32, expert_storage="fp4")
    packed.load_state_dict(dense.state_dict(), strict=False)
    packed.bind_tokenizer(tiny_v41_tokenizer())
    for (name, mod), (_, pmod) in zip(dense.named_modules(), packed.named_modules()):
        if name.endswith("ffn.experts"):
            for w in ("w1", "w2", "w3"):
                q, s = quantize_fp4(getattr(mod, w).data)
                getattr(pmod, f"{w}_fp4").copy_(q.view(torch.uint8))
                getattr(pmod, f"{w}_scale").copy_(s.view(torch.uint8))
                getattr(mod, w).data.copy_(dequantize_fp4(q, s, 32, torch.float32))
    assert same(compute_logits(packed, ids[None, :40]), compute_logits(dense, ids[None, :40]))


# ---------------------------------------------------------------- bad input: one clear line, state untouched


@pytest.mark.parametrize("chunks, states, match", [
    ([], 0, "no token chunks"),
    ([torch.tensor([5, 6]), torch.tensor([7])], 1, "2 token chunks for 1 sequence states"),
    ([torch.tensor([], dtype=torch.long)], 1, "non-empty 1-D"),
    ([torch.tensor([[5, 6]])], 1, "non-empty 1-D"),
    ([torch.tensor([5.0, 6.0])], 1, "must be integers"),
    ([torch.tensor([5, 600])], 1, r"token ids must lie in \[0, 512\)"),
])
def test_bad_chunks_get_one_line(model, chunks, states, match):
    sts = [new_state(model) for _ in range(states)]
    with pytest.raises(DeepInferError, match=match):
        extend(model, chunks, sts)
    assert all(st.num_tokens == 0 for st in sts)


def test_one_state_twice_in_a_batch_is_refused(model):
    st = new_state(model)
    with pytest.raises(DeepInferError, match="appears twice"):
        extend(model, [torch.tensor([5, 6]), torch.tensor([7])], [st, st])
    with pytest.raises(DeepInferError, match=r"shape \[B, T\] with T >= 1"):
        compute_logits(model, torch.zeros(1, 0, dtype=torch.long))


def test_draft_on_a_sequence_without_rings_is_refused_before_running(drafter, ids):
    st = new_state(drafter)
    extend(drafter, [ids[:10]], [st])
    windows = [layer.window.clone() for layer in st.layers]
    with pytest.raises(DeepInferError, match="DSpark rings of this sequence are empty"):
        extend_and_draft(drafter, [ids[10:12]], [st])
    assert st.num_tokens == 10 and all(torch.equal(a, b.window) for a, b in zip(windows, st.layers))


def test_swiglu_limit_zero_means_no_clamp():
    from deepinfer.models.common.moe import swiglu
    g, u = torch.tensor([20.0, -3.0]), torch.tensor([30.0, 2.0])
    assert torch.equal(swiglu(g, u, 0.0), torch.nn.functional.silu(g) * u)
    assert torch.equal(swiglu(g, u, 10.0), torch.nn.functional.silu(g.clamp(max=10)) * u.clamp(-10, 10))


def test_draft_distributions(drafter, ids):
    _, _, d = extend_and_draft(drafter, [ids[:30]], [new_state(drafter)])
    p = d.probs()
    assert torch.allclose(p.sum(-1), torch.ones(1, drafter.cfg.dspark_block_size, dtype=p.dtype))
    assert torch.equal(p.argmax(-1), d.tokens)          # greedy drafts are the modes of their distributions
    assert ((d.acceptance_confidence() > 0) & (d.acceptance_confidence() < 1)).all()
    with pytest.raises(DeepInferError, match="temperature must be > 0"):
        d.probs(0)
