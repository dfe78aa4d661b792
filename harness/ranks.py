"""Multi-rank sweep points on torch.distributed: one engine replica per rank (data parallel), launched by torchrun.

    torchrun --nproc-per-node 2 $(which deepinfer-bench) sweep my-sweep.yaml      # a sweep with decode_ranks: 2

A point of a role with r ranks runs on ranks 0..r-1 of the launch: its c concurrent requests are split over
min(r, c) replicas (replica i holds c_i = c // active (+1 for the first c % active) of them and gets the same
share of the point's requests), every replica starts after one barrier, and rank 0 gathers the request timings
(relative to that barrier, so one clock) and writes the row. Throughput per GPU divides by r, the role's size.
A role with ep > 1 is instead one expert-parallel engine over the launch's ranks (LLM(data_parallel_size=r,
enable_expert_parallel=True) on every rank, sharing this module's process group): the same split of requests,
but every rank steps in lockstep (LLM.generate_local), a rank without a share running idle steps.
Backend: NCCL on GPUs, gloo on CPU (the CI test runs two CPU ranks)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, device: str) -> str:
        """The device this rank's engine uses: its own GPU (cuda:LOCAL_RANK) in a multi-rank CUDA launch."""
        return f"cuda:{self.local_rank}" if self.world > 1 and device == "cuda" else device


def from_env() -> Ranks:
    """This process's place in a torchrun launch (a single process when not launched by torchrun)."""
    return Ranks(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def init(device: str) -> Ranks:
    """Join the launch's process group (NCCL for cuda, gloo for cpu); a no-op for one process. An expert-parallel
    engine built later joins this same group (engine/parallel/ranks.join finds it initialized and checks its size
    and backend), so the harness and the engine share one transport; its timeout is the engine's default."""
    ranks = from_env()
    if ranks.world > 1:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from deepinfer.llm import ENGINE_DEFAULTS
        if device == "cuda":
            torch.cuda.set_device(ranks.local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                    timeout=timedelta(seconds=ENGINE_DEFAULTS["distributed_timeout_s"]))
    return ranks


def finish(ranks: Ranks) -> None:
    if ranks.world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()


def share(ranks: Ranks, obj):
    """Rank 0's `obj` on every rank."""
    if ranks.world == 1:
        return obj
    import torch.distributed as dist
    box = [obj if ranks.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(ranks: Ranks, obj) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if ranks.world == 1:
        return [obj]
    import torch.distributed as dist
    out = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def barrier(ranks: Ranks) -> None:
    if ranks.world > 1:
        import torch.distributed as dist
        dist.barrier()


def split(concurrency: int, num_prompts: int, role_ranks: int) -> list[tuple[int, int, int]]:
    """(concurrency, first request, end request) per replica of a role of `role_ranks` ranks: min(ranks, c)
    replicas are active; request shares follow the concurrency shares (cumulative rounding, so they sum up)."""
    active = min(role_ranks, concurrency)
    shares = [concurrency // active + (i < concurrency % active) for i in range(active)]
    bounds, total = [0], 0
    for c in shares:
        total += c
        bounds.append(round(num_prompts * total / concurrency))
    return [(c, bounds[i], bounds[i + 1]) for i, c in enumerate(shares)]
