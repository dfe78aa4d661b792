"""The step bench's one-GPU rank view of expert parallelism: `deepinfer-bench step --ep 2,8,64 --rank R`.

One engine build, then:
  pool     the model's routing of other tokens: decode steps of the largest batch over random ids and state through
           the whole model (eager, routing recorded per MoE layer), (max EP - 1) x the largest batch rows per
           layer; the other ranks' rows
  views    per EP size N > 1, engine/parallel/rank_view.py makes the model rank R of EP-N (its experts, its
           EPLB slots with --eplb-redundant) and every point of that size is measured as the step bench measures
           one (harness/step_bench.py), CUDA graphs captured anew per view (the view's dispatch is static, as a
           device-count backend's would be): the roofline counts this rank's experts and the pairs it computes; the
           row's `expert_parallel` holds the exchange the view left out (all-to-all bytes each way), the pairs
           every rank computes per layer and their balancedness (mean / max over ranks)
  EP 1     the plain one-device step, for the ratio in the same run."""

from __future__ import annotations

import torch

from deepinfer.errors import DeepInferError
from deepinfer.parallel.balancer import placement_for
from deepinfer.parallel.dispatch import record_routing
from deepinfer.parallel.rank_view import rank_view

def routing_pool(llm, probe_cls, rows: int, point, seed: int) -> dict[str, torch.Tensor]:
    """MoE name -> [rows, k] logical expert ids: the model's routing of decode steps shaped like `point` (its batch,
    context and query length) over random tokens and state (seeds after the bench's own), recorded on the whole
    model before any view. Decode steps, not prefills: V4.1's upper layers compute only a prefill's last rows."""
    got: dict[str, list[torch.Tensor]] = {}
    done, i = 0, 0
    while done < rows:
        probe = probe_cls(llm, batch_size=point.batch, context_len=point.context, query_len=point.query_len,
                          seed=seed + 1 + i)
        try:
            with record_routing() as rec:
                probe.run(eager=True)
        finally:
            probe.close()
        for name, ids in rec.calls:
            got.setdefault(name, []).append(ids.detach().clone())
        done, i = done + point.rows, i + 1
    return {name: torch.cat(parts)[:rows] for name, parts in got.items()}


def placements(pool: dict[str, torch.Tensor], n_experts: dict[str, int], redundant: int, size: int) -> dict:
    """EPLB's placement of each layer from the pool's load (a static placement from a recorded load), or {}."""
    if not redundant:
        return {}
    out = {}
    for name, ids in pool.items():
        e = n_experts.get(name)
        if e is None:
            continue
        if (e + redundant) % size:
            raise DeepInferError(f"--eplb-redundant {redundant}: {e} experts + {redundant} redundant slots do not "
                                 f"divide over {size} ranks; pick a count that makes E + R a multiple of every --ep")
        load = torch.bincount(ids.reshape(-1).cpu(), minlength=e).double()
        out[name] = placement_for(load[None], e + redundant, size)
    return out


def views(llm, cfg, pool: dict[str, torch.Tensor], n_experts: dict[str, int]):
    """(EP size, the view or None for EP 1, points) per --ep size: a generator; each view is open while its
    points are measured."""
    drafting = llm.model.drafting
    keep_whole = drafting.modules if drafting is not None else ()
    for size in cfg.ep:
        pts = [p for p in cfg.points() if p.ep == size]
        if size == 1:
            yield size, None, pts
            continue
        llm.engine.modules_changed()           # graphs of the whole model (or another view) must not replay here
        try:
            with rank_view(llm.model, size, cfg.ep_rank, pool,
                           placements(pool, n_experts, cfg.eplb_redundant, size), keep_whole) as view:
                yield size, view, pts
        finally:
            llm.engine.modules_changed()


def pool_shape(cfg):
    """The step the pool records: the largest batch at the first context (the points' query length)."""
    return max(cfg.points(), key=lambda p: (p.rows, -cfg.contexts.index(p.context)))


def pool_rows(cfg) -> int:
    """Rows per layer the largest view needs from the pool."""
    return (max(cfg.ep) - 1) * max(p.rows for p in cfg.points())
