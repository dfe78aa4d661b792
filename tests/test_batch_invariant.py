"""Batch-invariant mode (the `invariant` kernel table): a sequence's logits are bitwise the same alone or in any
batch, through the reference forward (extend) and the runtime forward over the pools.

Model tests run the tiny V4 (fp32, no QAT) and V4.1 (fp32, QAT) models: one target sequence is prefilled and
then decoded alone, and again inside batches of 2, 5 and 9 other sequences of different lengths (first, middle
and last in the batch; the others keep prefilling in chunks of varying size while the target decodes). With the
mode on every logit is torch.equal; the control shows the same comparisons differ with the mode off.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from deepinfer.errors import DeepInferError
from deepinfer.env import kernel_backend
from deepinfer.kernels.attention import sparse_sink_attention
from deepinfer.kernels.matmul import grouped_linear, linear
from deepinfer.kernels.table import use
from deepinfer.kernels.tiles import TILE, row_tiles
from deepinfer.models.common.moe import MoE
from deepinfer.reference import extend, extend_and_draft, new_state

from .helpers import our_model
from .helpers_v41 import tiny_v41_model
from .pooled_helpers import PooledSequences

OTHER_LENGTHS = (5, 24, 17, 1, 33, 9, 20, 12, 28)   # the other sequences' prompt lengths
TARGET_LENGTH = 23
DECODE_STEPS = 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- the switch

def test_backend_choice_from_the_environment(monkeypatch):
    monkeypatch.delenv("DEEPINFER_KERNEL_BACKEND", raising=False)
    for raw, want in (("1", "invariant"), ("true", "invariant"), (" ON ", "invariant"), ("0", "reference"),
                      ("", "reference"), ("off", "reference")):
        monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", raw)
        assert kernel_backend() == want
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert kernel_backend("invariant") == "invariant"
    with pytest.raises(DeepInferError, match="selects batch-invariant kernels but kernel_backend='reference'"):
        kernel_backend("reference")
    with pytest.raises(DeepInferError, match="'triton' needs a CUDA device"):
        kernel_backend("triton", "cpu")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "sometimes")
    with pytest.raises(DeepInferError, match="DEEPINFER_BATCH_INVARIANT='sometimes'"):
        kernel_backend()
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT")
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "fastest")
    with pytest.raises(DeepInferError, match="DEEPINFER_KERNEL_BACKEND='fastest': use one of reference, invariant, "
                                             "triton, triton_invariant"):
        kernel_backend()


def test_row_tiles_structure():
    x, y = torch.randn(37, 3), torch.arange(37)
    calls = []

    def fn(a, none, b):
        calls.append(a.shape[0])
        assert none is None
        return a * 2, None, b + 1
    a, none, b = row_tiles(fn, x, None, y)
    assert calls == [TILE] * 3 and none is None
    assert torch.equal(a, x * 2) and torch.equal(b, y + 1)
    assert row_tiles(lambda t: t + 1, x[:0]).shape == (0, 3)
    assert torch.equal(row_tiles(lambda t: t + 1, x[:TILE]), x[:TILE] + 1)


# ---------------------------------------------------------------------------------------------- the ops

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_matches_torch(dtype):
    g = _gen(0)
    for shape, n in (((1, 64), 96), ((37, 64), 96), ((5, 3, 48), 130), ((64,), 7), ((200, 256), 33)):
        x, w = torch.randn(*shape, generator=g, dtype=dtype), torch.randn(n, shape[-1], generator=g, dtype=dtype)
        with use("reference"):
            assert torch.equal(linear(x, w), F.linear(x, w))          # normal mode: the torch op itself
        with use("invariant"):
            got = linear(x, w)
        assert got.shape == F.linear(x, w).shape
        torch.testing.assert_close(got, F.linear(x, w))
    x, w = torch.randn(45, 2, 192, generator=g, dtype=dtype), torch.randn(2, 32, 192, generator=g, dtype=dtype)
    want = torch.einsum("ngi,gri->ngr", x, w)
    with use("reference"):
        assert torch.equal(grouped_linear(x, w), want)
    with use("invariant"):
        torch.testing.assert_close(grouped_linear(x, w), want)


def _assert_rows_invariant(fn, rows: int, *inputs):
    """fn(*inputs[a:b]) must give bitwise the rows of fn(*inputs) for every window [a, b)."""
    full = fn(*inputs)
    for m in (1, 2, 7, 15, 16, 17, 33, 50):
        for start in (0, 1, 13, 21):
            if start + m <= rows:
                part = fn(*(t[start:start + m] for t in inputs))
                assert torch.equal(part, full[start:start + m]), (m, start)


def test_ops_are_tile_invariant():
    g = _gen(1)
    x, w = torch.randn(80, 256, generator=g), torch.randn(96, 256, generator=g)
    xg, wg = torch.randn(80, 2, 192, generator=g), torch.randn(2, 32, 192, generator=g)
    q, kv = torch.randn(80, 4, 96, generator=g), torch.randn(80, 24, 96, generator=g)
    bias = torch.zeros(80, 24).masked_fill(torch.rand(80, 24, generator=g) < 0.3, float("-inf"))
    sink = torch.randn(4, generator=g)
    with use("invariant"):
        _assert_rows_invariant(lambda t: linear(t, w), 80, x)
        _assert_rows_invariant(lambda t: grouped_linear(t, wg), 80, xg)
        store = kv.flatten(0, 1)                                        # each row its own 24 keys
        index = torch.where(bias == 0, torch.arange(80 * 24).view(80, 24), -1)
        _assert_rows_invariant(lambda a, i: sparse_sink_attention(a, [(store, i)], sink, 0.1), 80, q, index)


def test_plain_linear_is_not_row_invariant_here():
    """Measured fact the mode exists for: the plain op gives a row different bits in a batch of another size."""
    g = _gen(2)
    x, w = torch.randn(80, 256, generator=g), torch.randn(96, 256, generator=g)
    full = F.linear(x, w)
    if all(torch.equal(F.linear(x[:m], w), full[:m]) for m in range(1, 80)):
        pytest.skip("this CPU's BLAS gives every row the same bits at every M (nothing for the mode to fix)")


# ---------------------------------------------------------------------------------------------- the models

@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    if request.param == "v4":
        return our_model(dtype=torch.float32)
    return tiny_v41_model(dtype=torch.float32)


def _prompts(vocab: int):
    g = _gen(3)
    return torch.randint(0, vocab, (TARGET_LENGTH,), generator=g), \
        [torch.randint(0, vocab, (n,), generator=g) for n in OTHER_LENGTHS]


def _run(model, target, others, slot: int, **options) -> list[torch.Tensor]:
    """Prefill the target (at batch position `slot`) with the others, then decode it while the others keep
    extending by 1..5 tokens a step. Returns the target's logits: prefill, then each decode step."""
    vocab = model.cfg.vocab_size
    seqs = others[:slot] + [target] + others[slot:]
    states = [new_state(model) for _ in seqs]
    got = [extend(model, seqs, states, **options)[slot]]
    for step in range(DECODE_STEPS):
        g = _gen(100 + step)
        chunks = [torch.randint(0, vocab, (1 if i == slot else int(torch.randint(1, 6, (1,), generator=g)),),
                                generator=g) for i in range(len(seqs))]
        chunks[slot] = torch.randint(0, vocab, (1,), generator=_gen(200 + step))   # the target's own tokens
        got.append(extend(model, chunks, states)[slot])
    return got


BATCHES = [(n_others, slot) for n_others in (2, 5, 9) for slot in sorted({0, n_others // 2, n_others})]


def _differences(model, batches=BATCHES, **options) -> list[tuple[int, int, int]]:
    """(others, slot, step) of every target logit that is not bitwise its value alone."""
    target, others = _prompts(model.cfg.vocab_size)
    alone = _run(model, target, [], 0, **options)
    bad = []
    for n_others, slot in batches:
        got = _run(model, target, others[:n_others], slot, **options)
        bad += [(n_others, slot, step) for step, (a, b) in enumerate(zip(alone, got)) if not torch.equal(a, b)]
    return bad


@pytest.mark.usefixtures("one_thread")
def test_logits_independent_of_batch(model):
    with use("invariant"):
        assert _differences(model) == []


def _run_pooled(model, target, others, slot: int, last_only: bool = False) -> list[torch.Tensor]:
    """_run through the runtime forward over the pools, every step reading all block columns (the engine's
    fixed context in this mode): the target's last logits of the prefill, then of each decode step."""
    vocab = model.cfg.vocab_size
    seqs = others[:slot] + [target] + others[slot:]
    pooled = PooledSequences(model, len(seqs), 128, block_tokens=16 if model.cfg.model_type == "deepseek_v41" else None,
                             fixed_context=True)
    slots = list(range(1, len(seqs) + 1))
    got = [pooled.step(dict(zip(slots, seqs)), last_only=last_only)[slot + 1][-1:]]
    for step in range(DECODE_STEPS):
        g = _gen(100 + step)
        chunks = [torch.randint(0, vocab, (1 if i == slot else int(torch.randint(1, 6, (1,), generator=g)),),
                                generator=g) for i in range(len(seqs))]
        chunks[slot] = torch.randint(0, vocab, (1,), generator=_gen(200 + step))
        got.append(pooled.step(dict(zip(slots, chunks)))[slot + 1])
    return got


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("last_only", [False, True])
def test_runtime_forward_independent_of_batch(model, last_only):
    """The pooled forward (what the engine runs): the target's logits alone = inside batches of others that
    prefill in chunks while it decodes; with last_only the V4.1 prefill pieces run YOCO-truncated."""
    target, others = _prompts(model.cfg.vocab_size)
    with use("invariant"):
        alone = _run_pooled(model, target, [], 0, last_only)
        for n_others, slot in [(2, 1), (5, 5), (9, 0)]:
            got = _run_pooled(model, target, others[:n_others], slot, last_only)
            assert all(torch.equal(a, b) for a, b in zip(alone, got)), (n_others, slot)


@pytest.mark.usefixtures("one_thread")
def test_yoco_prefill_independent_of_batch():
    """V4.1's truncated prefill (last_only) too."""
    with use("invariant"):
        assert _differences(tiny_v41_model(dtype=torch.float32), [(2, 2), (9, 4)], last_only=True) == []


@pytest.mark.usefixtures("one_thread")
def test_control_mode_off_differs(model):
    """Without the mode the same comparisons are not bitwise equal on this CPU (so the test above can fail)."""
    with use("reference"):
        target, others = _prompts(model.cfg.vocab_size)
        alone = _run(model, target, [], 0)
        got = _run(model, target, others[:5], 2)
    assert any(not torch.equal(a, b) for a, b in zip(alone, got))


@pytest.mark.usefixtures("one_thread")
def test_moe_layers_give_a_row_the_same_bits_in_any_batch(model):
    """Every MoE layer (scored and hash-routed; route -> dispatch -> grouped experts -> combine + shared expert)
    under the invariant backend: a row's output is bitwise the same alone and at any place in batches of other
    sizes, so graph-captured decode and eager prefill see the same MoE bits (no routing mode to switch)."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert layers
    g = _gen(7)
    for moe in layers:
        x = torch.randn(40, moe.gate.weight.shape[1], generator=g).to(moe.experts.dtype)
        ids = torch.randint(0, model.cfg.vocab_size, (40,), generator=g) if moe.gate.is_hash else None
        with use("invariant"):
            alone = moe(x[5:6], None if ids is None else ids[5:6])[0]
            for n in (2, 9, 16, 17, 40):
                rows = [i for i in range(40) if i != 5][: n - 1]
                for place in (0, len(rows) // 2, len(rows)):
                    pick = rows[:place] + [5] + rows[place:]
                    got = moe(x[pick], None if ids is None else ids[pick])[place]
                    assert torch.equal(got, alone), (n, place)


@pytest.mark.usefixtures("one_thread")
def test_v41_drafts_independent_of_batch():
    """extend_and_draft: target logits, DSpark draft logits and confidences of a sequence alone = in a batch."""
    model = tiny_v41_model(dtype=torch.float32)
    target, others = _prompts(model.cfg.vocab_size)
    with use("invariant"):
        _, logits, drafts = extend_and_draft(model, [target], [new_state(model)])
        seqs = others[:3] + [target] + others[3:6]
        _, logits_b, drafts_b = extend_and_draft(model, seqs, [new_state(model) for _ in seqs])
    assert torch.equal(logits[0], logits_b[3])
    assert torch.equal(drafts.logits[0], drafts_b.logits[3])
    assert torch.equal(drafts.confidence[0], drafts_b.confidence[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_cuda_logits_independent_of_batch(arch, dtype):
    """The same on a GPU (cuBLAS GEMMs of one tile shape, torch reductions on fixed tiles), fp32 and bf16."""
    model = our_model(dtype=dtype, device="cuda") if arch == "v4" else tiny_v41_model(dtype=dtype, device="cuda")
    with use("invariant"):
        assert _differences(model) == []
    with use("triton_invariant"):           # the CUDA default's partner: Triton experts on one tile config
        assert _differences(model) == []
    with use("reference"):
        off = _differences(model)
    print(f"\n[batch invariance, cuda {arch} {dtype}] mode off: {len(off)} of {len(BATCHES) * (DECODE_STEPS + 1)} "
          f"target logits differ from alone")
