"""Expert traffic in every row: experts touched per step against a uniform router's expectation, and the load.

A decode step's cost is mostly the expert weights it reads, and how many experts it reads is a property of the
routing. A random model whose routers send every token to the same few experts reads 3-5x fewer expert bytes
than a trained one (docs/results.md), so a row that does not say how its model routed cannot be trusted to
transfer. Every bench row carries `expert_traffic` (the same fields whichever bench made it):

  touched_per_step     distinct experts routed to per forward, summed over the main stack's MoE layers
  uniform_per_step     what a uniform router touches at the same forwards' rows: sum of E (1 - (1 - k/E)^N)
  touched_vs_uniform   their ratio (1: balanced and diverse; a trained router sits near 1)
  load_max_over_mean   the busiest expert's (row, slot) pairs over the mean, over every forward, in the layer
                       that exceeds chance most (load_worst_layer)
  mean_load            pairs per expert of that layer (a uniform router's max/mean is ~1 + 3 / sqrt(it))
  load_over_noise      that max/mean over the chance bound (m + 4 sqrt(m) + 2) / m at that mean load m
  layers               per MoE layer: experts, top_k, forwards, rows, touched / uniform per forward, max/mean
  draft                the same totals for draft layers (V4.1 DSpark stages, V4 MTP), which run other batches
  balanced             touched_vs_uniform >= BALANCED_TOUCHED and load_over_noise <= MAX_OVER_NOISE
"""

from __future__ import annotations

import math

from deepinfer.parallel.traffic import uniform_touched

BALANCED_TOUCHED = 0.8          # at least this share of a uniform router's distinct experts per step
NOISE_SIGMAS = 4.0              # the busiest uniform expert stays under m + 4 sqrt(m) + 2 pairs (module doc)
MAX_OVER_NOISE = 2.0            # busiest expert at most 2x that chance bound: beyond it, hot experts
DRAFT_PREFIXES = ("mtp.",)      # module names of draft layers (DSpark stages and V4's MTP are `mtp.N`)


def layer_summary(calls, n_experts: dict[str, int]) -> dict[str, dict]:
    """calls: (MoE name, ids [N, k]) per forward (an eager forward's routing record) -> per-layer summary in the
    engine counters' form (engine/parallel/traffic.py ExpertTraffic.summary)."""
    import torch
    layers: dict[str, dict] = {}
    loads: dict[str, torch.Tensor] = {}
    for name, ids in calls:
        e = n_experts.get(name)
        if e is None:
            continue
        n, k = ids.shape
        counts = torch.bincount(ids.reshape(-1).cpu(), minlength=e)
        s = layers.setdefault(name, {"experts": e, "top_k": k, "forwards": 0, "rows": 0, "touched": 0.0,
                                     "uniform": 0.0})
        s["forwards"] += 1
        s["rows"] += n
        s["touched"] += int((counts > 0).sum())
        s["uniform"] += uniform_touched(e, k, n)
        loads[name] = loads.get(name, 0) + counts
    out = {}
    for name, s in layers.items():
        load = loads[name].float()
        out[name] = {"experts": s["experts"], "top_k": s["top_k"], "forwards": s["forwards"], "rows": s["rows"],
                     "touched_per_forward": s["touched"] / s["forwards"],
                     "uniform_per_forward": s["uniform"] / s["forwards"],
                     "load_max_over_mean": float(load.max() / load.mean()) if load.sum() else None}
    return out


def excess_load(v: dict) -> float | None:
    """A layer's max/mean over the max/mean a uniform router reaches by chance at the same load (> 1: more skew
    than sampling noise explains). With m pairs per expert the busiest of E uniform experts stays under
    m + NOISE_SIGMAS sqrt(m) + 2 (Poisson tail plus the one-pair floor of a small load)."""
    mm = v.get("load_max_over_mean")
    if mm is None:
        return None
    m = v["rows"] * v["top_k"] / v["experts"]
    return mm / noise_bound(m)


def noise_bound(mean_load: float) -> float:
    """The max/mean a uniform router stays under by chance at `mean_load` pairs per expert."""
    m = max(mean_load, 1e-9)
    return (m + NOISE_SIGMAS * math.sqrt(m) + 2.0) / m


def _totals(layers: dict[str, dict]) -> dict:
    if not layers:
        return {}
    touched = sum(v["touched_per_forward"] for v in layers.values())
    uniform = sum(v["uniform_per_forward"] for v in layers.values())
    worst_name, w = max(layers.items(), key=lambda kv: excess_load(kv[1]) or 0.0)
    return {"touched_per_step": round(touched, 2), "uniform_per_step": round(uniform, 2),
            "touched_vs_uniform": round(touched / uniform, 4) if uniform else None,
            "load_max_over_mean": None if w["load_max_over_mean"] is None else round(w["load_max_over_mean"], 4),
            "load_worst_layer": worst_name, "mean_load": round(w["rows"] * w["top_k"] / w["experts"], 2),
            "load_over_noise": None if excess_load(w) is None else round(excess_load(w), 4)}


def traffic_summary(layers: dict[str, dict] | None) -> dict | None:
    """Per-layer counters (engine stats or layer_summary) -> the row's `expert_traffic` (module doc)."""
    if not layers:
        return None
    main = {n: v for n, v in layers.items() if not n.startswith(DRAFT_PREFIXES)}
    draft = {n: v for n, v in layers.items() if n.startswith(DRAFT_PREFIXES)}
    out = {**_totals(main), "layers": {n: _rounded(v) for n, v in layers.items()}}
    if draft:
        out["draft"] = _totals(draft)
    ratio, over = out.get("touched_vs_uniform"), out.get("load_over_noise")
    out["balanced"] = bool(ratio is not None and ratio >= BALANCED_TOUCHED and (over is None or over <= MAX_OVER_NOISE))
    return out


def _rounded(v: dict) -> dict:
    return {k: round(x, 4) if isinstance(x, float) else x for k, x in v.items()}


def traffic_fields(stats) -> dict:
    """{"expert_traffic": ...} from an engine's stats (LLM(expert_traffic=True)); None when it has no counters."""
    return {"expert_traffic": traffic_summary(getattr(stats, "expert_traffic", None))}


def traffic_warning(row: dict) -> str | None:
    """One line when a row's model routed far from balanced (None when it is balanced or says nothing)."""
    t = row.get("expert_traffic")
    if not t or t.get("balanced", True):
        return None
    return (f"warning: {row.get('key', 'row')}: routing far from balanced ({t['touched_per_step']:.0f} experts "
            f"touched per step where a uniform router touches {t['uniform_per_step']:.0f}, "
            f"{t['touched_vs_uniform']:.2f}x; busiest expert {t['load_max_over_mean']:.2f}x the mean load): "
            f"its figures will not transfer to a trained checkpoint")


TRAFFIC_COLUMNS = ["experts_touched_per_step", "experts_uniform_per_step", "load_max_over_mean", "routing_balanced"]


def traffic_columns(row: dict) -> dict:
    """The row's traffic as flat summary.csv columns (TRAFFIC_COLUMNS; empty cells without traffic)."""
    t = row.get("expert_traffic") or {}
    return dict(zip(TRAFFIC_COLUMNS, (t.get("touched_per_step"), t.get("uniform_per_step"),
                                      t.get("load_max_over_mean"), t.get("balanced"))))


def routing_verdict(rows: list[dict]) -> str:
    """A run's routing in one index cell: `balanced` when every row with traffic is, `N of M rows unbalanced`,
    or `not recorded` (rows older than the traffic fields, or benches without a model)."""
    seen = [r["expert_traffic"] for r in rows if r.get("expert_traffic")]
    if not seen:
        return "not recorded"
    bad = sum(not t.get("balanced", True) for t in seen)
    return f"{bad} of {len(seen)} rows unbalanced" if bad else "balanced"


TRAFFIC_HEADER = f"{'touched/uniform max/mean':<24}"     # the bench tables' column of traffic_cell


def traffic_cell(row: dict) -> str:
    """`touched/uniform max/mean` for report tables ('-' without traffic)."""
    t = row.get("expert_traffic")
    if not t or t.get("touched_per_step") is None:
        return "-"
    mm = t.get("load_max_over_mean")
    flag = "" if t.get("balanced", True) else " !"
    return f"{t['touched_per_step']:.0f}/{t['uniform_per_step']:.0f} {mm:.2f}{flag}" if mm is not None else \
        f"{t['touched_per_step']:.0f}/{t['uniform_per_step']:.0f}{flag}"
