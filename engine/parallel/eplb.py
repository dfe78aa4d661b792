"""Expert-parallel load balancing (DeepSeek's EPLB): from each layer's measured expert load, which logical expert every
physical expert slot holds, so that hot experts get replicas and every GPU gets about the same load.

Hierarchical policy (the expert groups divide evenly over the nodes; group-limited routing keeps a token's experts
within few nodes, so the groups stay whole on a node):
  1. pack the expert groups onto the nodes, the same number of groups per node, balancing the groups' load;
  2. within each node, replicate its experts into the node's physical slots: each new replica goes to the expert
     whose load per replica is highest;
  3. pack each node's replicas onto its GPUs, the same number per GPU, balancing the load per replica.
Global policy (otherwise): the same with one group and one node: replicate over all slots, pack onto all GPUs.

Packing is greedy over items in descending load: each goes to the least loaded pack that still has room (ties:
the lowest index); replication ties go to the lowest expert id.

    phy2log, log2phy, counts = rebalance(load, num_physical, num_groups, num_nodes, num_gpus)

load [L, E] (tokens routed per logical expert per layer) -> phy2log [L, P] (slots GPU-major: GPU g holds slots
g*P/G .. (g+1)*P/G - 1), log2phy [L, E, max replicas] (-1 padded), counts [L, E] (replicas of each expert)."""

from __future__ import annotations

import torch

from ..errors import DeepInferError


def pack(loads: list[float], num_packs: int) -> list[tuple[int, int]]:
    """Items with `loads` into num_packs packs of len(loads) / num_packs items each -> (pack, place in the pack)
    per item: greedily, heaviest first, each to the lightest pack with room."""
    per_pack = len(loads) // num_packs
    totals, sizes = [0.0] * num_packs, [0] * num_packs
    where = [(-1, -1)] * len(loads)
    for item in sorted(range(len(loads)), key=lambda i: -loads[i]):      # stable: equal loads keep id order
        p = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: totals[p])
        where[item] = (p, sizes[p])
        totals[p] += loads[item]
        sizes[p] += 1
    return where


def replicate(loads: list[float], num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """len(loads) experts into num_slots >= len(loads) slots: slot i < len(loads) holds expert i, each further slot
    a replica of the expert with the highest load per replica -> (expert of each slot, its replica rank, replicas
    per expert)."""
    n = len(loads)
    experts, ranks, counts = list(range(n)), [0] * n, [1] * n
    for _ in range(n, num_slots):
        e = max(range(n), key=lambda i: loads[i] / counts[i])              # first maximum: the lowest id
        experts.append(e)
        ranks.append(counts[e])
        counts[e] += 1
    return experts, ranks, counts


def _layer(load: list[float], num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
           ) -> tuple[list[int], list[int]]:
    """One layer, hierarchical -> (logical expert of each physical slot, its replica rank)."""
    n = len(load)
    group_size, groups_per_node = n // num_groups, num_groups // num_nodes
    slots_per_node, slots_per_gpu = num_physical // num_nodes, num_physical // num_gpus
    group_loads = [sum(load[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_experts = [[0] * (groups_per_node * group_size) for _ in range(num_nodes)]   # node -> its logical experts
    for g, (node, place) in enumerate(pack(group_loads, num_nodes)):
        for j in range(group_size):
            node_experts[node][place * group_size + j] = g * group_size + j
    phy2log, phy_rank = [0] * num_physical, [0] * num_physical
    for node, experts in enumerate(node_experts):
        local, ranks, counts = replicate([load[e] for e in experts], slots_per_node)
        per_replica = [load[experts[m]] / counts[m] for m in local]
        for slot, (gpu, place) in enumerate(pack(per_replica, num_gpus // num_nodes)):
            at = node * slots_per_node + gpu * slots_per_gpu + place
            phy2log[at], phy_rank[at] = experts[local[slot]], ranks[slot]
    return phy2log, phy_rank


def check_rebalance(num_experts: int, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    problems = [(num_physical < num_experts, f"{num_physical} physical experts cannot hold {num_experts} experts"),
                (num_physical % num_gpus != 0, f"{num_physical} physical experts do not divide over {num_gpus} GPUs"),
                (num_gpus % num_nodes != 0, f"{num_gpus} GPUs do not divide over {num_nodes} nodes"),
                (num_experts % num_groups != 0, f"{num_experts} experts do not divide into {num_groups} groups")]
    for bad, why in problems:
        if bad:
            raise DeepInferError(f"EPLB: {why}")


def rebalance(load: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """load [L, E] -> (phy2log [L, P], log2phy [L, E, max replicas] -1 padded, counts [L, E]); module docstring."""
    num_layers, n = load.shape
    check_rebalance(n, num_physical, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes:
        num_groups = num_nodes = 1                                        # the global policy
    rows = [_layer(load[i].double().tolist(), num_physical, num_groups, num_nodes, num_gpus) for i in range(num_layers)]
    phy2log = torch.tensor([r[0] for r in rows], dtype=torch.long)
    rank = torch.tensor([r[1] for r in rows], dtype=torch.long)
    counts = torch.zeros(num_layers, n, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    log2phy = torch.full((num_layers, n, int(counts.max())), -1, dtype=torch.long)
    slots = torch.arange(num_physical).expand(num_layers, -1)
    log2phy.view(num_layers, -1).scatter_(1, phy2log * log2phy.shape[2] + rank, slots)
    return phy2log, log2phy, counts


def balancedness(load: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """[L] mean over max of the per-GPU load of each layer (1.0: perfectly even), each expert's load split evenly
    over its replicas."""
    counts = torch.zeros_like(load, dtype=torch.float64).scatter_add_(1, phy2log, torch.ones_like(phy2log,
                                                                                                  dtype=torch.float64))
    per_slot = (load.double() / counts).gather(1, phy2log)                 # [L, P]
    per_gpu = per_slot.view(load.shape[0], num_gpus, -1).sum(-1)
    return per_gpu.mean(-1) / per_gpu.max(-1).values.clamp_min(1e-30)

