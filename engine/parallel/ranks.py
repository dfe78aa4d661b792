"""The ranks an engine spans: one process per rank under torchrun, NCCL between GPUs, gloo between CPU processes.

    torchrun --nproc-per-node N script.py          # script: LLM(..., data_parallel_size=N, enable_expert_parallel=True)
    torchrun --nnodes M --node-rank I --rdzv-endpoint HOST:PORT --nproc-per-node G script.py      # N = M * G

Every rank runs the same script: the same LLM arguments and the same generate() calls. Each rank runs attention
for its share of the requests (attention data parallelism) and, with expert parallelism, holds 1/N of the routed
experts (engine/parallel/expert_parallel.py). Collectives go through torch.distributed only; every one is
bounded by the process group's timeout, so a rank that dies ends the others with an error instead of a hang."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import DeepInferError

# the tensor collectives under their newer names where torch has them (the older ones warn there)
_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
LAUNCH_HINT = "launch one process per rank with `torchrun --nproc-per-node N ...` (docs/parallel.md)"


@dataclass(frozen=True)
class ParallelConfig:
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_dispatch: str = "allgather"      # engine/parallel/expert_parallel.py DISPATCHERS
    timeout_s: float = 600.0                # any collective waiting longer ends the run
    prefill_context_parallel_size: int = 1  # C: long prompts prefilled over groups of C ranks (context_parallel.py)
    context_parallel_min_tokens: int | None = None     # prompts longer than this are (None: max_num_batched_tokens)


@dataclass
class Ranks:
    """This process's place among the ranks of one engine."""
    rank: int
    size: int
    local_rank: int
    backend: str                            # "nccl" | "gloo"
    group: object = None                    # the process group (None: the default one)

    # ---- the collectives an engine issues, all here: a lost rank becomes one error line on every other ----
    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on one (a host value: one small all-reduce)."""
        t = torch.tensor([int(flag)], device=self._device())
        self.all_reduce(t, dist.ReduceOp.MAX)
        return bool(t.item())

    def max(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long, device=self._device())
        self.all_reduce(t, dist.ReduceOp.MAX)
        return int(t.item())

    def gather_objects(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        out = [None] * self.size
        self._call(dist.all_gather_object, out, obj)
        return out

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        self._call(dist.all_reduce, t, op=op)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[n, ...] per rank -> [size * n, ...], rank-major."""
        out = t.new_empty(self.size * t.shape[0], *t.shape[1:])
        self._call(_GATHER_INTO, out, t.contiguous())
        return out

    def broadcast(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """Rank `src`'s t (its index in this group) into t on every rank, in place; returns t."""
        self._call(dist.broadcast, t, group_src=src)
        return t

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[size * n, ...] per rank -> this rank's [n, ...] block of the sum over ranks."""
        if t.shape[0] % self.size:
            raise ValueError(f"reduce_scatter of {t.shape[0]} rows over {self.size} ranks")
        out = t.new_empty(t.shape[0] // self.size, *t.shape[1:])
        self._call(_REDUCE_SCATTER, out, t.contiguous())
        return out

    def all_to_all(self, t: torch.Tensor, rows: int, send_splits: list | None = None,
                   recv_splits: list | None = None) -> torch.Tensor:
        """Rows of t to the ranks (send_splits[r] rows to rank r; None: even) -> the `rows` rows received."""
        out = t.new_empty(rows, *t.shape[1:])
        self._call(dist.all_to_all_single, out, t.contiguous(), recv_splits, send_splits)
        return out

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, group=self.group, **kwargs)
        except RuntimeError as e:
            if not _lost_peer(e):
                raise                      # a bad argument, out of memory, ...: the error as it is
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DeepInferError(f"rank {self.rank} of {self.size} lost the other ranks in {fn.__name__} ({first[:200]}): "
                                 f"another rank stopped or failed (see its output), or waited past "
                                 f"distributed_timeout_s") from None

    def split(self, size: int) -> "Ranks":
        """This rank's group of `size` consecutive ranks (ranks g*size .. (g+1)*size - 1; size divides self.size).
        Every rank creates every group, in the same order, as torch.distributed requires."""
        groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(self.size // size)]
        return Ranks(self.rank % size, size, self.local_rank, self.backend, groups[self.rank // size])

    def device(self, requested: str) -> str:
        """The device this rank computes on: `cuda` means this rank's GPU (join chose it)."""
        return f"cuda:{torch.cuda.current_device()}" if requested == "cuda" else requested

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")


_LOST = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "peer", "socket",
         "remote process", "nccl error", "ncclremoteerror", "ncclsystemerror")


def _lost_peer(e: RuntimeError) -> bool:
    """The error a collective raises when another rank is gone (torch.distributed's own kinds, or gloo's plain
    RuntimeError about the connection), not one about its arguments."""
    return isinstance(e, dist.DistError) or any(w in str(e).lower() for w in _LOST)


def join(config: ParallelConfig, device: str) -> Ranks | None:
    """The ranks of this launch for `config` (None: one rank, nothing to join). Refuses, in one line, a launch that
    does not match the configuration."""
    n = config.data_parallel_size
    if n == 1:
        return None
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise DeepInferError(f"data_parallel_size={n} runs one process per rank, but this process was not started "
                             f"by torchrun: {LAUNCH_HINT}")
    if int(world) != n:
        raise DeepInferError(f"data_parallel_size={n}, but torchrun started {world} processes: launch with "
                             f"--nproc-per-node (x --nnodes) = {n}, or set data_parallel_size={world}")
    backend = "nccl" if device.startswith("cuda") else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if device != "cuda":
            raise DeepInferError(f"device={device!r} with data_parallel_size={n}: every rank would use that GPU; "
                                 f"use device='cuda' (each rank takes its LOCAL_RANK's GPU)")
        visible = torch.cuda.device_count()
        if visible != 1 and local_rank >= visible:         # one visible GPU: a per-rank CUDA_VISIBLE_DEVICES
            raise DeepInferError(f"rank {os.environ.get('RANK')} is local rank {local_rank}, but this node has "
                                 f"{visible} GPUs: start at most that many processes per node")
        torch.cuda.set_device(0 if visible == 1 else local_rank)
    if dist.is_initialized():
        if dist.get_world_size() != n or dist.get_backend() != backend:
            raise DeepInferError(f"torch.distributed is already initialized with {dist.get_world_size()} ranks over "
                                 f"{dist.get_backend()}; this engine needs {n} over {backend}")
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout_s))
    return Ranks(dist.get_rank(), n, local_rank, backend)


DISPATCH_BACKENDS = ("allgather", "alltoall", "nccl_ep", "deepep")
BUILT_DISPATCH = ("allgather", "alltoall")         # engine/parallel/expert_parallel.py DISPATCHERS
# the device-count backends: the library each needs (its import name, what to install)
DEVICE_COUNT_DISPATCH = {"nccl_ep": ("nccl.ep", "nccl4py's EP API (nccl4py[cu13] with libnccl_ep)"),
                         "deepep": ("deep_ep", "DeepEP (built from its repository; PyPI's deep-ep is a placeholder)")}


def parallel_config(args: dict, given: set[str]) -> ParallelConfig:
    """LLM's parallel arguments -> a ParallelConfig; `given`: the argument names the caller passed. One line for
    any value that is wrong or that the other settings would leave unused."""
    n = args["data_parallel_size"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise DeepInferError(f"data_parallel_size={n!r} must be an integer >= 1")
    ep = args["enable_expert_parallel"]
    if not isinstance(ep, bool):
        raise DeepInferError(f"enable_expert_parallel={ep!r} must be True or False")
    if ep and n == 1:
        raise DeepInferError("enable_expert_parallel=True splits the routed experts over the data-parallel ranks, "
                             "and data_parallel_size=1 is one rank: raise data_parallel_size or drop it")
    backend = args["expert_dispatch"]
    if backend not in DISPATCH_BACKENDS:
        raise DeepInferError(f"expert_dispatch={backend!r}: use one of {list(DISPATCH_BACKENDS)}")
    if "expert_dispatch" in given and not ep:
        raise DeepInferError("expert_dispatch chooses how expert-parallel ranks exchange rows: set "
                             "enable_expert_parallel=True or drop it")
    if backend in DEVICE_COUNT_DISPATCH:
        _refuse_device_count_dispatch(backend)
    timeout = args["distributed_timeout_s"]
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise DeepInferError(f"distributed_timeout_s={timeout!r} must be a number of seconds > 0")
    if "distributed_timeout_s" in given and n == 1:
        raise DeepInferError("distributed_timeout_s bounds the collectives between ranks; data_parallel_size=1 has "
                             "none: drop it")
    c, at_least = args["prefill_context_parallel_size"], args["context_parallel_min_tokens"]
    _check_context_parallel(n, ep, c, at_least, given)
    if c > 1 and args.get("speculative") is not None:
        raise DeepInferError("speculative with prefill_context_parallel_size is not validated yet (a context-parallel "
                             "prefill keeps no draft rings): drop one of them")
    return ParallelConfig(n, ep, backend, float(timeout), c, at_least)


def _refuse_device_count_dispatch(backend: str) -> None:
    """The slot for a backend whose split sizes stay on the device (no host read per MoE layer, so steps can be
    graphed): one line when its library is missing, and one line when it is present, since the backend on it
    needs a multi-GPU machine to be validated against allgather / alltoall (docs/parallel.md)."""
    module, what = DEVICE_COUNT_DISPATCH[backend]
    try:
        importlib.import_module(module)
    except Exception as e:                          # missing, or present but failing to load its native library
        raise DeepInferError(f"expert_dispatch={backend!r} needs {what}, and `import {module}` fails here "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no message'}); install "
                             f"it or use one of {list(BUILT_DISPATCH)}") from None
    raise DeepInferError(f"expert_dispatch={backend!r}: {module} imports, but deepinfer's backend on it is not built "
                         f"yet (it waits for a multi-GPU machine to be validated on); use one of "
                         f"{list(BUILT_DISPATCH)}")


def _check_context_parallel(n: int, ep: bool, c, at_least, given: set[str]) -> None:
    """One line for a context-parallel setting that is wrong, unused, or not validated with the others."""
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise DeepInferError(f"prefill_context_parallel_size={c!r} must be an integer >= 1")
    if n % c:
        raise DeepInferError(f"prefill_context_parallel_size={c} must divide data_parallel_size={n} (groups of "
                             f"{c} consecutive ranks prefill each long prompt)")
    if ep and c > 1:
        raise DeepInferError("prefill_context_parallel_size with enable_expert_parallel=True is not validated yet: "
                             "drop one of them")
    if "context_parallel_min_tokens" in given:
        if c == 1:
            raise DeepInferError("context_parallel_min_tokens chooses which prompts prefill over several ranks: set "
                                 "prefill_context_parallel_size > 1 or drop it")
        if isinstance(at_least, bool) or not isinstance(at_least, int) or at_least < 1:
            raise DeepInferError(f"context_parallel_min_tokens={at_least!r} must be an integer >= 1")
