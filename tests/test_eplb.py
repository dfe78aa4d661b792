"""EPLB (engine/parallel/eplb.py): the public algorithm's worked example, consistent maps, and balance that improves."""

import pytest
import torch

from deepinfer.errors import DeepInferError
from deepinfer.parallel.eplb import balancedness, pack, rebalance, replicate

# deepseek-ai/EPLB's README: 2 layers of 12 experts in 4 groups, 16 replicas on 2 nodes of 4 GPUs (hierarchical)
README_LOAD = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                            [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_the_readme_example():
    phy2log, log2phy, counts = rebalance(README_LOAD, 16, 4, 2, 8)
    assert phy2log.tolist() == README_PHY2LOG
    _check_consistent(phy2log, log2phy, counts, 12)


def _check_consistent(phy2log, log2phy, counts, n_experts):
    layers, slots = phy2log.shape
    assert counts.sum(1).tolist() == [slots] * layers and (counts >= 1).all()
    for layer in range(layers):
        for e in range(n_experts):
            replicas = [p for p in log2phy[layer, e].tolist() if p >= 0]
            assert len(replicas) == counts[layer, e]
            assert all(phy2log[layer, p] == e for p in replicas)
            assert sorted(replicas) == sorted(p for p in range(slots) if phy2log[layer, p] == e)


def test_pack_and_replicate():
    assert pack([5, 1, 4, 2], 2) == [(0, 0), (0, 1), (1, 0), (1, 1)]      # 5+1 and 4+2
    experts, ranks, counts = replicate([10, 1, 4], 5)
    assert experts == [0, 1, 2, 0, 0] and ranks == [0, 0, 0, 1, 2] and counts == [3, 1, 1]


@pytest.mark.parametrize("groups, nodes, gpus, floor", [(8, 1, 8, 0.85), (3, 2, 4, 0.85), (8, 2, 8, 0.6),
                                                        (8, 4, 8, 0.6)])
def test_balance_improves_on_a_skewed_load(groups, nodes, gpus, floor):
    """One node (or groups that do not divide over the nodes: the global policy) balances the GPUs well; more nodes
    keep each group on one node, which bounds how far a few hot groups can spread."""
    gen = torch.Generator().manual_seed(0)
    load = (torch.rand(3, 48, generator=gen) ** 6 * 1000).round() + 1                    # a few hot experts
    identity = torch.arange(64).remainder(48).expand(3, -1)       # 16 redundant slots as a naive round-robin
    phy2log, log2phy, counts = rebalance(load, 64, groups, nodes, gpus)
    _check_consistent(phy2log, log2phy, counts, 48)
    before, after = balancedness(load, identity, gpus), balancedness(load, phy2log, gpus)
    assert (after > before).all() and (after > floor).all(), (before, after)


def test_bad_shapes_are_one_line():
    with pytest.raises(DeepInferError, match="do not divide over 8 GPUs"):
        rebalance(README_LOAD, 20, 4, 2, 8)
    with pytest.raises(DeepInferError, match="cannot hold 12 experts"):
        rebalance(README_LOAD, 8, 4, 2, 8)
