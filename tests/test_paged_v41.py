"""The paged decode step (models/paged_v41.py) against the reference decode (model.extend on SequenceStates).

Sequences are prefilled with the reference path, stored into the pools, then decoded together by decode_step
(a padding row on slot 0, rows at different positions, block tables not in order) for enough steps that
every window wraps, every source's groups close, candidate blocks move and sequences cross a block boundary.
float64 with and without QAT: every step's logits within 1e-9 of the reference's (the quantizers are
discontinuous, so a path computing anything differently would miss by far more), and the pools, loaded back
into SequenceStates, continue exactly as the reference states do.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from deepinfer.cache.pools import PoolLayout, StatePools
from deepinfer.models.engram import BLOCKED
from deepinfer.models.paged_v41 import decode_step

from .helpers_v41 import tiny_v41_model

TOL = 1e-9
BLOCK_TOKENS = 8                          # small blocks (the layout's default is 64): many block boundaries
PREFILL = {1: 0, 2: 3, 3: 17, 4: 29}      # slot -> prompt length (slot 1 starts empty)
BLOCKS = {1: [7, 1, 12], 2: [2, 9, 4], 3: [5, 11, 3, 8], 4: [10, 6, 13, 14, 15, 16]}   # out of order
ROWS = [3, 0, 1, 4, 2, 0]                 # batch rows -> slots (0 = padding)
STEPS = 12                                # W = 8, ratios 2 and 1, candidate blocks of 4 entries
CTX_BLOCKS = 6
REAL = [i for i, s in enumerate(ROWS) if s]


def _prefilled(model, gen, device=torch.device("cpu")):
    """Reference states after each slot's prompt, and pools holding the same."""
    layout = dataclasses.replace(PoolLayout.for_model(model), block_tokens=BLOCK_TOKENS)
    pools = StatePools(layout, num_slots=4, num_blocks=16, max_model_len=64, device=device)
    states = {}
    for slot, n in PREFILL.items():
        pools.block_table[slot, :len(BLOCKS[slot])] = torch.tensor(BLOCKS[slot], dtype=torch.int32)
        states[slot] = model.new_state()
        if n:
            model.extend([_random_ids(model, n, gen)], [states[slot]])
            pools.store_state(slot, states[slot], 0)
        else:
            pools.engram[slot] = BLOCKED      # a fresh slot: nothing before the start (pools start at 0)
    return pools, states


def _random_ids(model, n: int, gen) -> torch.Tensor:
    return torch.randint(5, model.cfg.vocab_size, (n,), generator=gen).to(model.device)


def _step_inputs(model, states, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """slots, positions, tokens [B] of the next decode step (padding rows at position 0)."""
    positions = [states[s].num_tokens if s else 0 for s in ROWS]
    return (torch.tensor(ROWS, device=model.device), torch.tensor(positions, device=model.device),
            _random_ids(model, len(ROWS), gen))


def _reference(model, states, tokens) -> torch.Tensor:
    """The reference decode of the real rows, one token each: [R, vocab]."""
    return torch.cat(model.extend([tokens[i:i + 1] for i in REAL], [states[ROWS[i]] for i in REAL]))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("qat", [True, False])
def test_decode_step_matches_reference(qat):
    model = tiny_v41_model(torch.float64, qat=qat)
    gen = torch.Generator().manual_seed(11)
    pools, states = _prefilled(model, gen)
    worst = 0.0
    for _ in range(STEPS):
        slots, positions, tokens = _step_inputs(model, states, gen)
        got = decode_step(model, pools, slots, positions, tokens, CTX_BLOCKS)
        assert got.shape == (len(ROWS), model.cfg.vocab_size) and got.dtype == torch.float32
        err = _max_diff(got[REAL], _reference(model, states, tokens))
        assert err <= TOL, (positions.tolist(), err)
        worst = max(worst, err)
    print(f"qat={qat}: decode max |diff| {worst:.3g}")
    # the pools, loaded into fresh states, continue exactly as the reference states
    cont = _random_ids(model, 5, gen)
    for slot, st in states.items():
        loaded = pools.load_state(slot, st.num_tokens, model.new_state())
        assert loaded.nbytes() == st.nbytes()
        err = _max_diff(model.extend([cont], [loaded])[0], model.extend([cont], [st])[0])
        print(f"qat={qat}: slot {slot} continuation max |diff| {err:.3g}")
        assert err <= TOL, (slot, err)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qat", [False, True])
def test_decode_step_cuda_graph(qat):
    """Captured once with every row on scratch, then replayed with the real rows written into its inputs: the
    same logits as the eager step (run with host synchronisation made an error) and the reference decode."""
    model = tiny_v41_model(torch.float64, qat=qat, device="cuda")
    gen = torch.Generator().manual_seed(11)
    pools, states = _prefilled(model, gen, model.device)
    eager_pools = copy.deepcopy(pools)
    inputs = torch.zeros(3, len(ROWS), dtype=torch.long, device=model.device)   # slots, positions, tokens
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            decode_step(model, pools, *inputs, CTX_BLOCKS)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_step(model, pools, *inputs, CTX_BLOCKS)
    worst = worst_eager = 0.0
    for _ in range(STEPS):
        step = _step_inputs(model, states, gen)
        inputs.copy_(torch.stack(step))
        graph.replay()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = decode_step(model, eager_pools, *step, CTX_BLOCKS)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        worst_eager = max(worst_eager, _max_diff(out[REAL], eager[REAL]))
        worst = max(worst, _max_diff(out[REAL], _reference(model, states, step[2])))
    print(f"qat={qat}: graph vs eager max |diff| {worst_eager:.3g}, vs reference {worst:.3g}")
    assert worst_eager <= 1e-12 and worst <= TOL
