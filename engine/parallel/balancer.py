"""EPLB in a running engine: `LLM(..., enable_expert_parallel=True, enable_eplb=True, eplb_config={...})`.

    eplb_config = {"num_redundant_experts": R,     # physical slots beyond the E logical experts, per layer
                   "window_size": W,               # steps of load the placement looks at (default 1000)
                   "step_interval": S,             # rebalance every S steps (default 3000; 0: never, static)
                   "load": "load.json"}            # optional: the first placement from a recorded load

Each expert-parallel dispatcher counts the logical experts its own rows route to (one index_add on the device per
layer and forward). After every engine step the balancer files that count into a window of the last W steps;
every S steps the ranks sum their windows (one all-reduce), compute the new placement (engine/parallel/eplb.py,
the same on every rank) and move the expert weights: per layer and stacked tensor, one all-gather of the held
slots, from which each rank copies the experts of its new slots. The ranks step in lockstep, so they rebalance at
the same step; replicas hold the same weights and the combine order is by logical id, so a rebalance changes no
output (bitwise, with invariant kernels). The all-gather moves every slot of one layer tensor at a time (bounded
by one layer's experts); point-to-point moves of only the changed slots would cost less and are not built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DeepInferError
from .eplb import rebalance
from .expert_parallel import Placement
from .ranks import Ranks

EPLB_KEYS = ("num_redundant_experts", "window_size", "step_interval", "load")
DEFAULTS = {"window_size": 1000, "step_interval": 3000, "load": None}


@dataclass(frozen=True)
class EplbConfig:
    num_redundant_experts: int
    window_size: int = 1000
    step_interval: int = 3000
    load: dict | None = None         # MoE module name -> [E] recorded load (write_load's file)


def eplb_config(enable: bool, value, expert_parallel: bool, given: set[str]) -> EplbConfig | None:
    """LLM's enable_eplb / eplb_config -> an EplbConfig (None: off); one line for what is wrong or unused."""
    if not isinstance(enable, bool):
        raise DeepInferError(f"enable_eplb={enable!r} must be True or False")
    if not enable:
        if "eplb_config" in given:
            raise DeepInferError("eplb_config configures EPLB: set enable_eplb=True or drop it")
        return None
    if not expert_parallel:
        raise DeepInferError("enable_eplb=True places experts over expert-parallel ranks: set "
                             "enable_expert_parallel=True (docs/parallel.md)")
    if not isinstance(value, dict) or "num_redundant_experts" not in value or set(value) - set(EPLB_KEYS):
        raise DeepInferError(f"eplb_config={value!r} must be a dict with num_redundant_experts and optionally "
                             f"{list(EPLB_KEYS[1:])} (docs/parallel.md)")
    args = {**DEFAULTS, **value}
    for key, low in (("num_redundant_experts", 0), ("window_size", 1), ("step_interval", 0)):
        v = args[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise DeepInferError(f"eplb_config {key}={v!r} must be an integer >= {low}")
    load = None if args["load"] is None else read_load(args["load"])
    return EplbConfig(args["num_redundant_experts"], args["window_size"], args["step_interval"], load)


def write_load(path: str | Path, traffic) -> None:
    """The routed load an engine's expert-traffic counters saw (LLM(expert_traffic=True)), as EPLB's input."""
    layers = {name: load.tolist() for name, load in zip(traffic.names, traffic.load)}
    Path(path).write_text(json.dumps({"layers": layers}) + "\n")


def read_load(path) -> dict:
    try:
        layers = json.loads(Path(path).read_text())["layers"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DeepInferError(f"eplb_config load={str(path)!r}: not a load file written by "
                             f"deepinfer.parallel.balancer.write_load ({type(e).__name__}: {e})") from None
    if not isinstance(layers, dict) or not all(
            isinstance(v, list) and v and all(isinstance(x, (int, float)) and x >= 0 for x in v)
            for v in layers.values()):
        raise DeepInferError(f"eplb_config load={str(path)!r}: each layer must map to a list of loads >= 0")
    return layers


def layer_placement(config: EplbConfig, name: str, n_experts: int, num_gpus: int) -> Placement:
    """One MoE layer's first placement over num_gpus ranks: from the recorded load, else an even load (the
    replicas then go to the lowest ids until the first rebalance). The global policy: no expert groups."""
    if config.load is None:
        load = [1.0] * n_experts
    else:
        load = config.load.get(name)
        if load is None or len(load) != n_experts:
            raise DeepInferError(f"eplb_config load has no {n_experts}-expert load for MoE layer {name!r}: record "
                                 f"it on this model (docs/parallel.md)")
    return placement_for(torch.tensor([load], dtype=torch.float64), n_experts + config.num_redundant_experts, num_gpus)


def placement_for(load: torch.Tensor, num_physical: int, num_gpus: int) -> Placement:
    """One layer's placement of load [1, E] on num_physical slots over num_gpus ranks (the global policy)."""
    phy2log, log2phy, counts = rebalance(load, num_physical, 1, 1, num_gpus)
    return Placement(phy2log[0], log2phy[0], counts[0])


class ExpertBalancer:
    """The window of routed load and the periodic rebalance of an expert-parallel engine (module docstring)."""

    def __init__(self, config: EplbConfig, dispatchers: list, ranks: Ranks):
        self.config, self.dispatchers, self.ranks = config, dispatchers, ranks
        self.windows = []
        for d in dispatchers:
            d.step_load = torch.zeros(d.n_experts, dtype=torch.long, device=_device(d))
            self.windows.append(torch.zeros(config.window_size, d.n_experts, dtype=torch.long,
                                            device=d.step_load.device))
        self.steps = self.rebalances = self.moved_slots = 0

    def after_step(self) -> None:
        """File this step's load; every step_interval steps, rebalance."""
        row = self.steps % self.config.window_size
        for d, window in zip(self.dispatchers, self.windows):
            window[row] = d.step_load
            d.step_load.zero_()
        self.steps += 1
        if self.config.step_interval and self.steps % self.config.step_interval == 0:
            self.rebalance()

    @torch.inference_mode()
    def rebalance(self) -> None:
        """Every rank: sum the windows over ranks, place anew, move the weights."""
        load = torch.stack([w.sum(0) for w in self.windows])                    # [L, E] this rank's rows
        self.ranks.all_reduce(load)
        for d, layer_load in zip(self.dispatchers, load.cpu().double()):
            new = placement_for(layer_load[None], d.shard.n_physical, self.ranks.size)
            self.moved_slots += self._move(d, new)
        self.rebalances += 1

    def _move(self, d, new: Placement) -> int:
        """Bring this rank's slots the experts `new` gives them -> how many of its slots changed expert."""
        old = d.placement.phy2log.cpu()
        first, count = d.shard.first, d.shard.count
        wanted = new.phy2log[first:first + count]
        source = [int((old == e).nonzero()[0]) for e in wanted.tolist()]            # a slot holding e now
        for t in d.slot_tensors():
            gathered = self.ranks.all_gather(t)                 # [P, ...] in the old slot order
            t.copy_(gathered[torch.tensor(source, device=t.device)])
        d.placement = new.to(d.placement.phy2log.device)
        return int((wanted != old[first:first + count]).sum())


def _device(dispatcher) -> torch.device:
    tensors = dispatcher.slot_tensors()
    return tensors[0].device if tensors else torch.device("cpu")
