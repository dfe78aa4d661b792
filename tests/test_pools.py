"""The state pools from the model's state spec: sizes, and snapshot / restore of a sequence's slot-fixed state."""

import pytest
import torch

from deepinfer.cache.pools import PoolLayout, StatePools
from deepinfer.cache.spec import Entries, Ring, StateSpec

from .helpers import our_model
from .helpers_v41 import tiny_v41_model
from .pooled_helpers import PooledSequences


def _model(family):
    return our_model(dtype=torch.float64, qat=True) if family == "v4" else tiny_v41_model(dtype=torch.float64)


def test_v4_spec_declares_every_state_kind():
    model = our_model()
    cfg, spec = model.cfg, model.state_spec()
    rings = {r.name: r for r in spec.rings}
    entries = {e.name: e for e in spec.entries}
    for layer, kind in enumerate(cfg.layer_types):
        assert rings[f"{layer}.window"].span == cfg.sliding_window
    # tiny V4: S, CSA (ratio 4, overlapping + indexer), HCA (16), CSA
    assert entries["1.kv"].ratio == 4 and entries["1.index"].width == cfg.index_head_dim
    assert rings["1.kv.pending_kv"].span == 8 and rings["1.kv.pending_kv"].width == 2 * cfg.head_dim
    assert rings["2.kv.pending_kv"].span == 16 and rings["2.kv.pending_kv"].width == cfg.head_dim
    assert "2.index" not in entries and "0.kv" not in entries


def test_v41_spec_declares_every_state_kind():
    model = tiny_v41_model()
    cfg, spec = model.cfg, model.state_spec()
    rings = {r.name: r for r in spec.rings}
    entries = {e.name: e for e in spec.entries}
    assert set(entries) == {f"{s}.kv" for s in cfg.kv_source_layer_ids} | {
        f"{s}.index" for s in cfg.kv_source_layer_ids if model.layers[s].attn.indexer is not None}
    assert rings["engram"].span == cfg.engram_max_ngram_size - 1 and rings["engram"].dtype == "int64"
    assert sum(n.startswith("mtp.") for n in rings) == cfg.num_nextn_predict_layers
    for s in cfg.kv_source_layer_ids:
        assert (f"{s}.kv.pending_kv" in rings) == (cfg.compress_ratios[s] > 1)


def test_layout_sizes():
    spec = StateSpec.of([Ring("w", 8, 4), Ring("p", 2, 3, "accum"), Entries("e", 4, 5), Entries("f", 16, 2)])
    lay = PoolLayout.of(spec, torch.bfloat16)
    assert lay.block_tokens == 64                                   # lcm(4, 16) rounded up to 64
    assert lay.bytes_per_slot() == 8 * 4 * 2 + 2 * 3 * 4
    assert lay.bytes_per_block() == 16 * 5 * 2 + 4 * 2 * 2
    assert lay.blocks_for(65) == 2 and lay.blocks_for(64) == 1
    pools = StatePools(lay, 2, 4, 256, torch.device("cpu"))
    assert pools.rings["p"].dtype == torch.float32 and pools.entries["e"].shape == (5, 16, 5)
    assert pools.nbytes() >= 4 * lay.bytes_per_block() + 2 * lay.bytes_per_slot()
    with pytest.raises(Exception, match="multiple of 16"):
        PoolLayout.of(spec, torch.bfloat16, block_tokens=40)


def test_duplicate_state_names_are_refused():
    with pytest.raises(ValueError, match="unique"):
        StateSpec.of([Ring("w", 8, 4), Entries("w", 4, 5)])


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_snapshot_restore_round_trip(family):
    """Snapshot a sequence's slot-fixed state, run on (every ring kind changes), restore: every ring row of the
    slot is bitwise what it was, the other slots are untouched, and feeding the same tokens again gives the
    same logits as the first time (a rollback)."""
    model = _model(family)
    seqs = PooledSequences(model, 2, 160, block_tokens=16 if family == "v41" else None)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, model.cfg.vocab_size, (140,), generator=g)
    seqs.step({1: ids[:50], 2: ids[:70]})
    before = {n: r.clone() for n, r in seqs.pools.rings.items()}
    snap = seqs.pools.snapshot(1)
    first = seqs.step({1: ids[50:90], 2: ids[70:71]})
    changed = [n for n, r in seqs.pools.rings.items() if not torch.equal(r[1], before[n][1])]
    written = [n for n in changed if not n.startswith("mtp.")]
    assert {n.split(".")[-1] for n in written} >= {"window", "pending_kv", "pending_score"}
    if family == "v41":
        assert "engram" in written
    seqs.pools.restore(1, snap)
    for n, r in seqs.pools.rings.items():
        assert torch.equal(r[1], before[n][1]), n
    seqs.done[1] = 50
    again = seqs.step({1: ids[50:90]})
    assert torch.equal(again[1], first[1])
