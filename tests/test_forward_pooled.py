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
from deepinfer.reference import extend, extend_and_draft, new_state

TOL = 1e-9


def _model(family: str, qat: bool, device: str = "cpu"):
    if family == "v4":
        return our_model(dtype=torch.float64, qat=qat, device=device)
    return tiny_v41_model(dtype=torch.float64, qat=qat, device=device)


def _tokens(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(5, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("qat", [False, True])
@pytest.mark.parametrize("select_block", [None, 64])
def test_mixed_flat_batches_equal_reference(family, qat, select_block, monkeypatch):
    """select_block 64: the indexer's selection walks the step's rows in small blocks (models/pooled.top_entries,
    what a long prefill does), with the candidate blocks of V4.1 published block by block."""
    if select_block is not None:
        from deepinfer.models.common import pooled
        monkeypatch.setattr(pooled, "SELECT_BLOCK_ELEMENTS", select_block)
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
    ref = {s: new_state(model) for s in total}
    worst = 0.0
    for feeds in plan:
        chunks = {s: ids[s][seqs.done[s]:seqs.done[s] + n] for s, n in feeds.items()}
        got = seqs.step(chunks)
        for s, chunk in chunks.items():
            want = extend(model, [chunk], [ref[s]])[0]
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


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_varlen_static_layout_equals_ragged(family):
    """The variable-length graph layout (segment lengths a device tensor, padding rows on scratch slot 0) gives
    what the ragged one gives, on CPU, through verify rows of 1..6 rows (rings with 5 positions of slack)."""
    model = _model(family, qat=True)
    a, b = (PooledSequences(model, 3, 200, block_tokens=16 if family == "v41" else None, ring_slack=5)
            for _ in range(2))
    prompts = {s: _tokens(model, 10 + 9 * s, seed=s) for s in (1, 2, 3)}
    a.step(prompts)
    b.step(prompts)
    worst = 0.0
    for i in range(12):
        feeds = {s: _tokens(model, 1 + (i * s + s) % 6, seed=100 * i + s) for s in (1, 2, 3)}
        got, want = b.step(feeds, varlen_pad=i % 4), a.step(feeds)
        worst = max(worst, max((got[s] - want[s]).abs().max().item() for s in feeds))
    assert worst <= TOL
    for name, ring in a.pools.rings.items():    # not bitwise: padding rows make the GEMMs another M
        assert torch.allclose(ring[1:], b.pools.rings[name][1:], atol=TOL, rtol=0), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("q", [1, 3, None])
def test_cuda_graph_replay_equals_eager(family, q):
    """Uniform steps (q rows a segment) and variable-length ones (q None: 1..6 rows a segment) replayed from a
    captured CUDA graph (runner/graphs.py, padded segments / rows on scratch) give the eager ragged forward's
    logits and leave the same state, float64 on the GPU; a step just under the row cap is a graph too."""
    from deepinfer.runner import ModelRunner
    from deepinfer.runner.graphs import StepGraphs
    from deepinfer.runner.inputs import StepInputs

    model = _model(family, qat=True, device="cuda")
    a, b = (PooledSequences(model, 3, 256, block_tokens=16 if family == "v41" else None, ring_slack=5)
            for _ in range(2))
    prompts = {s: _tokens(model, 10 + 9 * s, seed=s) for s in (1, 2, 3)}
    a.step(prompts)
    b.step(prompts)
    runner = ModelRunner(model, b.pools, cuda_graphs=False, max_graph_batch=4)     # what its graphs capture
    # a 15-row step pads to 15, not the ladder's 16
    graphs = StepGraphs(runner.static_logits, model.device, max_batch=4, max_rows=15)
    worst = 0.0
    for i in range(10):
        lens = [q or 1 + (i * s + s) % 6 for s in (1, 2, 3)]
        feeds = {s: _tokens(model, n, seed=100 * i + s) for s, n in zip((1, 2, 3), lens)}
        want = a.step(feeds)
        slots, starts = list(feeds), [b.done[s] for s in feeds]
        tokens = torch.cat(list(feeds.values())).cuda()
        last = max(a + n - 1 for a, n in zip(starts, lens))
        inputs = StepInputs([], slots, starts, lens, tokens, list(range(sum(lens))), last, q, True)
        got = graphs.run(inputs, b.ctx_blocks(last)).split(lens)
        for j, s in enumerate(slots):
            b.done[s] += lens[j]
            worst = max(worst, (got[j] - want[s]).abs().max().item())
    assert worst <= TOL and len(graphs.graphs) >= 1
    for name, ring in a.pools.rings.items():   # not bitwise: the padded graph batch runs GEMMs of another M
        assert torch.allclose(ring[1:], b.pools.rings[name][1:], atol=TOL, rtol=0), name


@pytest.mark.parametrize("qat", [False, True])
@pytest.mark.parametrize("select_block", [None, 64])
def test_v41_last_only_segments_run_truncated_and_exact(qat, select_block, monkeypatch):
    """V4.1 YOCO truncation in the runtime forward: segments marked last_only give the full forward's last
    logits and leave every state as it would (later steps equal), beside segments that need every row
    (select_block 64: the selection of the truncated layers' query rows in small row blocks)."""
    from deepinfer.cache.forward_batch import ForwardBatch
    if select_block is not None:
        from deepinfer.models.common import pooled
        monkeypatch.setattr(pooled, "SELECT_BLOCK_ELEMENTS", select_block)

    model = _model("v41", qat)
    full = PooledSequences(model, 3, 300, block_tokens=16)
    cut = PooledSequences(model, 3, 300, block_tokens=16)
    ids = {s: _tokens(model, 200, seed=s) for s in (1, 2, 3)}
    pieces = [{1: 90, 2: 40, 3: 3}, {1: 60, 2: 1, 3: 70}]
    for feeds in pieces:
        chunks = {s: ids[s][full.done[s]:full.done[s] + n] for s, n in feeds.items()}
        want = full.step(chunks)
        slots = list(feeds)
        starts, lens = [cut.done[s] for s in slots], [feeds[s] for s in slots]
        fb = ForwardBatch.ragged(cut.pools, slots, starts, lens, cut.ctx_blocks(max(a + n for a, n in zip(starts, lens))),
                                 last_only=[s != 2 for s in slots])          # slot 2 needs every row
        with torch.inference_mode():
            got = model.logits(model.forward(torch.cat(list(chunks.values())), fb))
        o = 0
        for s, n in zip(slots, lens):
            rows = got[o:o + n] if s == 2 else got[o + n - 1:o + n]
            ref = want[s] if s == 2 else want[s][-1:]
            assert (rows - ref).abs().max().item() <= TOL, (s, n)
            o += n
            cut.done[s] += n
    for step in range(5):                                  # the states the truncated pieces left are whole
        feeds = {s: ids[s][full.done[s]:full.done[s] + 1] for s in (1, 2, 3)}
        a, b = full.step(feeds), cut.step(feeds)
        assert max((a[s] - b[s]).abs().max().item() for s in feeds) <= TOL


def test_v41_draft_rings_written_in_place_equal_reference():
    """With draft_rings, the runtime forward keeps every DSpark stage's ring as extend_and_draft's observe does:
    kv(main_x) of the target features at each segment's last window positions, YOCO-truncated pieces included."""
    model = _model("v41", qat=True)
    seqs = PooledSequences(model, 2, 200, block_tokens=16)
    ids = {s: _tokens(model, 120, seed=10 + s) for s in (1, 2)}
    ref = {s: new_state(model) for s in (1, 2)}
    window = model.cfg.sliding_window
    for feeds in [{1: 40, 2: 5}, {1: 1, 2: 23}, {1: 3, 2: 1}, {1: 1, 2: 1}, {1: 17, 2: 2}]:
        chunks = {s: ids[s][seqs.done[s]:seqs.done[s] + n] for s, n in feeds.items()}
        seqs.step(chunks, last_only=True, draft_rings=True)
        for s, chunk in chunks.items():
            extend_and_draft(model, [chunk], [ref[s]])
            end = ref[s].num_mtp_tokens
            positions = torch.arange(end - ref[s].mtp[0].window.shape[0], end)
            assert positions.numel() == min(window, end)
            for i, layer in enumerate(ref[s].mtp):
                got = seqs.pools.rings[f"mtp.{i}.window"][s, positions % window]
                assert (got - layer.window).abs().max().item() <= TOL, (s, i)


def test_v41_pooled_draft_equals_reference_draft():
    """model.draft over the pools (the runtime's drafter) gives extend_and_draft's drafts, draft logits and
    confidences: after each step, both draft from the same position with the same anchor token."""
    model = _model("v41", qat=True)
    seqs = PooledSequences(model, 2, 200, block_tokens=16)
    ids = {s: _tokens(model, 120, seed=20 + s) for s in (1, 2)}
    ref = {s: new_state(model) for s in (1, 2)}
    dev = model.device
    for feeds in [{1: 40, 2: 5}, {1: 1, 2: 23}, {1: 3, 2: 1}, {1: 1, 2: 1}, {1: 130 - 40 - 5, 2: 2}][:4]:
        chunks = {s: ids[s][seqs.done[s]:seqs.done[s] + n] for s, n in feeds.items()}
        seqs.step(chunks, last_only=True, draft_rings=True)
        want = {s: extend_and_draft(model, [chunk], [ref[s]]) for s, chunk in chunks.items()}
        slots = list(chunks)
        anchor = torch.cat([want[s][0] for s in slots])
        with torch.inference_mode():
            got = model.draft(seqs.pools, torch.tensor(slots, device=dev),
                              torch.tensor([seqs.done[s] - 1 for s in slots], device=dev), anchor,
                              lambda i, logits: logits.argmax(dim=-1), model.cfg.dspark_block_size)
        for r, s in enumerate(slots):
            d = want[s][2]
            assert torch.equal(got.tokens[r], d.tokens[0]), s
            assert (got.logits[r] - d.logits[0]).abs().max().item() <= TOL
            assert (got.confidence[r] - d.confidence[0]).abs().max().item() <= TOL
