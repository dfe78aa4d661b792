"""What state a model keeps per sequence, as the model declares it (`model.state_spec()`).

Two kinds, which are all the cache needs to size, allocate, snapshot and restore a sequence's state:
  Ring     per sequence slot, fixed size: the last `span` positions, position p at row p % span
           (sliding-window latents, compressors' open-window buffers, token look-backs, draft rings)
  Entries  per block of positions, growing with the sequence: one entry per `ratio` positions
           (compressed KV entries, indexer keys)
A kind's dtype is "compute" (the model's dtype), "accum" (>= fp32: buffers the reference keeps in fp32) or
"int64" (token-derived ids). A ring's `depth` is how far back its rows' values reach through the layers below it:
position p of a layer-l window depends on the first layer's inputs at p - depth .. p (each window attention below
reaches W - 1 positions back, a token look-back n - 1), which is what bounded replay must recompute before a
prefix-cache hit (cache/prefix.py: replay_tokens). A kind the attention or the indexer reads may name `packed`, the release's FP8 / FP4
cache record for it (kernels/kv_formats.py): the pools store those records when the engine is built with
kv_cache_dtype="fp8", else the compute dtype."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from deepinfer.kernels.kv_formats import KVFormat

DTYPES = ("compute", "accum", "int64")


@dataclass(frozen=True)
class Ring:
    name: str
    span: int         # positions held
    width: int        # values per position
    dtype: str = "compute"
    packed: KVFormat | None = None      # the record kv_cache_dtype="fp8" stores instead
    depth: int = 0    # positions before a row whose first-layer inputs its value depends on (module docstring)


@dataclass(frozen=True)
class Entries:
    name: str
    ratio: int        # positions per entry
    width: int
    dtype: str = "compute"
    packed: KVFormat | None = None


@dataclass(frozen=True)
class StateSpec:
    rings: tuple[Ring, ...]
    entries: tuple[Entries, ...]

    def __post_init__(self):
        names = [k.name for k in self.rings + self.entries]
        if len(set(names)) != len(names):
            raise ValueError(f"state names must be unique; got {names}")
        for k in self.rings + self.entries:
            if k.dtype not in DTYPES:
                raise ValueError(f"state {k.name}: dtype {k.dtype!r} is not one of {DTYPES}")
            if k.packed is not None and k.dtype != "compute":
                raise ValueError(f"state {k.name}: only compute-dtype kinds have a packed record (got {k.dtype!r})")
            if k.packed is not None and k.packed.width != k.width:
                raise ValueError(f"state {k.name}: its record holds {k.packed.width} values, the kind {k.width}")

    @classmethod
    def of(cls, kinds) -> "StateSpec":
        kinds = list(kinds)
        return cls(tuple(k for k in kinds if isinstance(k, Ring)), tuple(k for k in kinds if isinstance(k, Entries)))

    def with_depths(self, depth_of) -> "StateSpec":
        """The spec with each ring's depth set to depth_of(ring name) (the model knows its layers' reach)."""
        return StateSpec(tuple(dataclasses.replace(r, depth=depth_of(r.name)) for r in self.rings), self.entries)

    def block_multiple(self) -> int:
        """Positions per block must be a multiple of every entry ratio."""
        return math.lcm(*[e.ratio for e in self.entries]) if self.entries else 1


def torch_dtype(kind: str, compute: torch.dtype) -> torch.dtype:
    if kind == "int64":
        return torch.int64
    if kind == "accum":
        return torch.float64 if compute == torch.float64 else torch.float32
    return compute
