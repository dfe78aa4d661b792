"""Incremental decode, chunked prefill at random split points and mixed flat batches equal the full forward."""

import random

import pytest
import torch

from deepinfer.config.presets import TINY_V4
from deepinfer.reference import compute_logits, extend, forward_reference, mtp_forward, new_state

from .helpers import SCHEDULES, our_model

TOL = 1e-4


def assert_matches(got, full, qat: bool):
    assert (got - full).abs().max().item() <= TOL


@pytest.fixture(scope="module", params=[("tiny", True), ("tiny", False), ("hca-first", True),
                                       ("hca-first", False), ("csa-only-no-hash", False)],
                ids=lambda p: f"{p[0]}-qat{int(p[1])}")
def model(request):
    # NOTE: with QAT on the model runs in float64. The FP8/FP4 fake-quantizers are discontinuous, so in
    # fp32 the rounding noise between a T-row and a T'-row matmul (different BLAS blocking) can flip one
    # quantized value and move later logits by up to ~0.3; in float64 that noise is gone and chunked,
    # decode and full forwards agree exactly (docs/model.md).
    name, qat = request.param
    return our_model(SCHEDULES[name], seed=5, qat=qat, dtype=torch.float64 if qat else torch.float32)


def _ids(n, seed):
    return torch.randint(0, TINY_V4.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(4))
def test_chunked_prefill_random_splits(model, seed):
    rng = random.Random(seed)
    length = rng.choice([129, 300, 517])
    ids = _ids(length, seed)
    full = compute_logits(model, ids.unsqueeze(0))[0]
    cuts = sorted(rng.sample(range(1, length), rng.randint(1, 6)))
    state, pieces = new_state(model), []
    for a, b in zip([0] + cuts, cuts + [length]):
        pieces.append(extend(model, [ids[a:b]], [state])[0])
    assert_matches(torch.cat(pieces), full, model.qat_fake_quant)
    assert state.num_tokens == length


def test_token_by_token_decode(model):
    ids = _ids(150, 11)
    full = compute_logits(model, ids.unsqueeze(0))[0]
    state = new_state(model)
    prefill = extend(model, [ids[:40]], [state])[0]
    steps = [extend(model, [ids[t:t + 1]], [state])[0] for t in range(40, 150)]
    assert_matches(torch.cat([prefill] + steps), full, model.qat_fake_quant)


def test_flat_batch_of_different_sequences(model):
    """Sequences at different positions share one forward; each equals its own full forward."""
    seqs = [_ids(n, 20 + n) for n in (37, 130, 65)]
    fulls = [compute_logits(model, s.unsqueeze(0))[0] for s in seqs]
    states = [new_state(model) for _ in seqs]
    outs = [[] for _ in seqs]
    offsets = [0, 0, 0]
    rng = random.Random(3)
    while any(o < len(s) for o, s in zip(offsets, seqs)):
        live = [i for i, s in enumerate(seqs) if offsets[i] < len(s)]
        chunks = []
        for i in live:
            step = rng.randint(1, 40)
            chunks.append(seqs[i][offsets[i]:offsets[i] + step])
        res = extend(model, chunks, [states[i] for i in live])
        for i, r in zip(live, res):
            outs[i].append(r)
            offsets[i] += r.shape[0]
    for got, full in zip(outs, fulls):
        assert_matches(torch.cat(got), full, model.qat_fake_quant)


def test_state_holds_only_bounded_window(model):
    state = new_state(model)
    extend(model, [_ids(300, 1)], [state])
    w = model.cfg.sliding_window
    for layer in state.layers:
        assert layer.window.shape[0] == w - 1
        if layer.compressor is not None:
            assert layer.compressor.pending_kv.shape[0] < max(dict(model.cfg.compress_rates).values())
            assert layer.compressor.entries.shape[0] >= 300 // max(dict(model.cfg.compress_rates).values())


def test_mtp_layer_runs_and_is_deterministic():
    model = our_model(TINY_V4, seed=6, qat=True)
    ids = _ids(50, 2)
    state = new_state(model)
    streams = forward_reference(model, ids, [(0, 50)], [state])
    next_ids = torch.cat([ids[1:], torch.tensor([3])])
    logits, out = mtp_forward(model, streams, next_ids, [(0, 50)], [state])
    again, _ = mtp_forward(model, streams, next_ids, [(0, 50)], [new_state(model)])
    assert logits.shape == (50, TINY_V4.vocab_size) and out.shape == streams.shape
    assert torch.equal(logits, again)
    assert not torch.allclose(logits, model.logits(model.collapse(streams)))  # the MTP layer changes the prediction
