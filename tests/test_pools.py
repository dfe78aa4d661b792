"""The state pools hold exactly what the reference path's SequenceState holds: a sequence continued from a
state loaded out of the pools gives the same logits as one continued from its own state."""

import pytest
import torch

from deepinfer.cache.pools import PoolLayout, StatePools

from .helpers import our_model
from .helpers_v41 import tiny_v41_model


def _models():
    return [("v4", our_model(dtype=torch.float64)), ("v41", tiny_v41_model(dtype=torch.float64))]


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_store_load_round_trip(family):
    model = dict(_models())[family]
    layout = PoolLayout.for_model(model)
    pools = StatePools(layout, num_slots=3, num_blocks=12, max_model_len=400, device=torch.device("cpu"))
    torch.manual_seed(1)
    ids = torch.randint(5, model.cfg.vocab_size, (150,))
    own = model.new_state()
    slot = 2
    for blk in range(1, 1 + layout.blocks_for(150)):
        pools.block_table[slot, blk - 1] = blk
    done = 0
    for cut in (37, 70, 71, 130):               # chunks through the pools vs through one state
        st = pools.load_state(slot, done, model.new_state())
        via_pool = model.extend([ids[done:cut]], [st])[0]
        pools.store_state(slot, st, done)
        direct = model.extend([ids[done:cut]], [own])[0]
        assert torch.allclose(via_pool, direct, atol=1e-10, rtol=0), (family, cut)
        done = cut
    loaded = pools.load_state(slot, done, model.new_state())
    assert loaded.nbytes() == own.nbytes()


def test_layout_sizes():
    model = tiny_v41_model()
    layout = PoolLayout.for_model(model)
    assert layout.block_tokens % 64 == 0
    assert all(layout.block_tokens % s.ratio == 0 for s in layout.streams)
    assert layout.bytes_per_token() > 0 and layout.bytes_per_slot() > 0
    pools = StatePools(layout, 2, 4, 256, torch.device("cpu"))
    assert pools.nbytes() >= 4 * layout.bytes_per_block() + 2 * layout.bytes_per_slot()
