"""Balancedness of an expert-parallel sweep point: how evenly the ranks' experts shared the routed work.

Under expert parallelism each rank's traffic counters (engine/parallel/traffic.py) count the pairs its *own* rows
routed, by logical expert. The work a rank's *experts* did is another split: the sum of every rank's load, cut by
the placement. Without EPLB rank r of N holds experts [r E/N, (r+1) E/N); with EPLB it holds physical slots
[r P/N, (r+1) P/N), slot p holding logical expert phy2log[p], and an expert with several replicas has its pairs
split evenly over them (EPLB's own measure, engine/parallel/eplb.balancedness: the dispatchers give row i replica
i mod count, so the split is even up to one pair per forward). A layer's balancedness is the mean over the max of
its pairs per rank (1: even; 1/N: one rank did everything); a row carries the mean and the minimum over the MoE
layers, and per layer the pairs per rank.

The placement read is the one at the end of the point: an EPLB rebalance inside a point (step_interval shorter than
the point) moves experts mid-way, and the split then describes the last placement."""

from __future__ import annotations

from collections import Counter


def rank_pairs(load: list[float], ranks: int, phy2log: list[int] | None = None) -> list[float]:
    """load [E]: one layer's pairs per logical expert, summed over ranks -> the pairs each rank's experts computed
    (module doc: contiguous experts, or EPLB's slots with replicas sharing their expert's pairs evenly)."""
    if phy2log is None:
        per = len(load) // ranks
        return [float(sum(load[r * per:(r + 1) * per])) for r in range(ranks)]
    replicas = Counter(phy2log)
    per = len(phy2log) // ranks
    return [sum(load[e] / replicas[e] for e in phy2log[r * per:(r + 1) * per]) for r in range(ranks)]


def balance_fields(per_rank_loads: list[dict], placement: dict[str, dict]) -> dict:
    """per_rank_loads: every rank's ExpertTraffic.loads() (rank order); placement: the expert-parallel layers'
    ExpertTraffic.expert_parallel_placement() -> the row's `balancedness` (mean over layers), `balancedness_min`
    and `expert_load` (pairs per rank summed over layers, and per layer: pairs, rows routed, top_k, pairs per
    rank, balancedness). Layers nothing was routed to are left out; no layer: None values."""
    layers = {}
    for name, where in placement.items():
        own = [loads[name] for loads in per_rank_loads if name in loads]
        load = [sum(column) for column in zip(*(o["load"] for o in own))]
        if not load or not sum(load):
            continue
        pairs = rank_pairs(load, where["ranks"], where["phy2log"])
        layers[name] = {"pairs": int(sum(load)), "rows": sum(o["rows"] for o in own),
                        "top_k": max(o["top_k"] for o in own), "pairs_per_rank": [round(p, 2) for p in pairs],
                        "balancedness": round(sum(pairs) / len(pairs) / max(pairs), 4)}
    if not layers:
        return {"balancedness": None, "balancedness_min": None, "expert_load": None}
    scores = [v["balancedness"] for v in layers.values()]
    total = [round(sum(col), 2) for col in zip(*(v["pairs_per_rank"] for v in layers.values()))]
    return {"balancedness": round(sum(scores) / len(scores), 4), "balancedness_min": min(scores),
            "expert_load": {"pairs_per_rank": total, "layers": layers}}
