"""The runtime forward over the state pools (model.forward + ForwardBatch) against the reference forward
(model.extend on SequenceStates), in float64: mixed flat batches of prefill chunks, decode and verify rows;
verify rows against single-token decode steps; the static (CUDA-graph) batch layout against the ragged one.
The sequences run long enough to wrap the sliding windows, close compressor windows, change the indexer's
candidate blocks and cross entry blocks (tiny V4: window 16, ratios 4/16, top-k 8; tiny V4.1: window 8,
ratios 1/2/4, candidate blocks of 4, engram layers; blocks of 64 or 16 positions)."""

import pytest
import torch

from .helpers import our_model
from .helpers_v41 import tiny_v41_model
from .pooled_helpers import PooledSequences

TOL = 1e-9


def _model(family: str, qat: bool):
    if family == "v4":
        return our_model(dtype=torch.float64, qat=qat)
    return tiny_v41_model(dtype=torch.float64, qat=qat)


def _tokens(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(5, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("qat", [False, True])
def test_mixed_flat_batches_equal_reference(family, qat):
    model = _model(family, qat)
    # (slot -> tokens fed per step): prefill chunks, decode rows and verify rows in the same steps
    plan = [{1: 70, 2: 33, 3: 1},
            {1: 1, 2: 40, 3: 5},
            {1: 4, 2: 1, 3: 17},
            *[{1: 1, 2: 1, 3: 1}] * 6,
            {1: 3, 2: 7, 3: 1},
            {1: 1, 2: 100, 3: 2}]
    total = {s: sum(p.get(s, 0) for p in plan) for s in (1, 2, 3)}
    seqs = PooledSequences(model, 3, max(total.values()) + 8, block_tokens=16 if family == "v41" else None)
    ids = {s: _tokens(model, total[s], seed=s) for s in total}
    ref = {s: model.new_state() for s in total}
    worst = 0.0
    for feeds in plan:
        chunks = {s: ids[s][seqs.done[s]:seqs.done[s] + n] for s, n in feeds.items()}
        got = seqs.step(chunks)
        for s, chunk in chunks.items():
            want = model.extend([chunk], [ref[s]])[0]
            worst = max(worst, (got[s] - want).abs().max().item())
    assert worst <= TOL, worst
    assert all(seqs.done[s] == total[s] for s in total)


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("q", [2, 4])
def test_verify_rows_equal_single_token_decode(family, q):
    """Slot 1 decodes one token per step, slot 2 the same tokens q+1 per step (a verify row): equal logits at
    every position, through window wraps, compressor closes and block boundaries."""
    model = _model(family, qat=True)
    n_prompt, n_decode = 21, 3 * 5 * (q + 1)
    ids = _tokens(model, n_prompt + n_decode, seed=7)
    seqs = PooledSequences(model, 2, n_prompt + n_decode + 4, block_tokens=16 if family == "v41" else None)
    seqs.step({1: ids[:n_prompt], 2: ids[:n_prompt]})
    single = [seqs.step({1: ids[p:p + 1]})[1] for p in range(n_prompt, n_prompt + n_decode)]
    single = torch.cat(single)
    verify = torch.cat([seqs.step({2: ids[p:p + q + 1]})[2] for p in range(n_prompt, n_prompt + n_decode, q + 1)])
    assert (single - verify).abs().max().item() <= TOL
    assert seqs.done[1] == seqs.done[2] > seqs.layout.block_tokens     # crossed a block boundary


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("q", [1, 3])
def test_static_layout_equals_ragged(family, q):
    """The CUDA-graph layout (every row a window candidate, masks instead of compact lists, all block columns)
    gives what the ragged one gives, on CPU."""
    model = _model(family, qat=True)
    a = PooledSequences(model, 3, 200, block_tokens=16 if family == "v41" else None)
    b = PooledSequences(model, 3, 200, block_tokens=16 if family == "v41" else None)
    prompts = {s: _tokens(model, 10 + 9 * s, seed=s) for s in (1, 2, 3)}
    a.step(prompts)
    b.step(prompts)
    worst = 0.0
    for i in range(12):
        feeds = {s: _tokens(model, q, seed=100 * i + s) for s in (1, 2, 3)}
        got, want = b.step(feeds, uniform=True), a.step(feeds)
        worst = max(worst, max((got[s] - want[s]).abs().max().item() for s in feeds))
    assert worst <= TOL
    for name, ring in a.pools.rings.items():
        assert torch.equal(ring[1:], b.pools.rings[name][1:]), name
