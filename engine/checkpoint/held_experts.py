"""Which routed experts each expert stack of a model holds, by checkpoint name: every expert on one rank; under
expert parallelism the rank's slots, allocated before any weight is read (engine/llm.py installs the dispatchers
on the unmaterialized model). The dispatcher says which logical expert each local slot holds; an EPLB placement
may hold an expert in two slots (a replica). The loader reads only these experts' tensors from the shards."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.common.moe import moe_layers


@dataclass(frozen=True)
class HeldExperts:
    """One expert stack: the checkpoint's experts.{0..n_experts-1}, and the local slots holding each held one."""
    n_experts: int                              # logical experts of the layer
    slots: dict[int, tuple[int, ...]]           # logical expert -> the local slots that hold it (held ones only)

    def slots_of(self, expert: int) -> tuple[int, ...]:
        return self.slots.get(expert, ())

    def elsewhere(self, expert: int) -> bool:
        """A valid expert id of this layer that another rank holds (its tensors are not read here)."""
        return 0 <= expert < self.n_experts and expert not in self.slots


def held_experts(model: torch.nn.Module) -> dict[str, HeldExperts]:
    """`layers.3.ffn.experts` -> what that stack holds, for every MoE of `model` (draft layers included)."""
    out = {}
    for name, moe in moe_layers(model):
        slots: dict[int, list[int]] = {}
        for slot, expert in enumerate(moe.dispatch.held_experts()):
            slots.setdefault(expert, []).append(slot)
        out[f"{name}.experts"] = HeldExperts(moe.gate.n_experts, {j: tuple(s) for j, s in slots.items()})
    return out
