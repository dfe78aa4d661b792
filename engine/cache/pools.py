"""Preallocated state pools: every state kind of every sequence lives in one fixed tensor per kind.

From the model's StateSpec (cache/spec.py):
  rings[name]    [S, span, width]   per sequence slot; position p at row p % span
  entries[name]  [NB, bt/ratio, w]  per block of `block_tokens` (bt) positions; entry j of a sequence (positions
                                    j*ratio .. j*ratio + ratio-1) lives at block_table[slot, j*ratio // bt],
                                    row j % (bt/ratio); every entry stream shares the one block table
  block_table    [S, max_blocks]    int32: a sequence's block k (positions k*bt .. (k+1)*bt - 1) -> pool block
Slot 0 and block 0 are scratch: padding rows of a CUDA-graph batch and writes that must go nowhere land there,
and nothing real ever reads them. The pools know nothing of the model beyond the spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import DeepInferError
from .spec import StateSpec, torch_dtype

MIN_BLOCK_TOKENS = 64
SCRATCH = 0


@dataclass(frozen=True)
class PoolLayout:
    """Sizes of one sequence's state, from the spec and the model dtype."""
    spec: StateSpec
    block_tokens: int
    dtype: torch.dtype            # the model's compute dtype

    @classmethod
    def of(cls, spec: StateSpec, dtype: torch.dtype, block_tokens: int | None = None) -> "PoolLayout":
        """block_tokens: positions per block (default: MIN_BLOCK_TOKENS rounded up to a multiple of every entry
        ratio); a given value must be such a multiple."""
        lcm = spec.block_multiple()
        if block_tokens is None:
            block_tokens = lcm * math.ceil(MIN_BLOCK_TOKENS / lcm)
        elif block_tokens < 1 or block_tokens % lcm:
            raise DeepInferError(f"block_size={block_tokens} must be a positive multiple of {lcm} (every compress "
                                 f"ratio of this model divides a block)")
        return cls(spec, block_tokens, dtype)

    @classmethod
    def for_model(cls, model, block_tokens: int | None = None) -> "PoolLayout":
        return cls.of(model.state_spec(), model.dtype, block_tokens)

    def _el(self, kind: str) -> int:
        return torch.empty(0, dtype=torch_dtype(kind, self.dtype)).element_size()

    def bytes_per_slot(self) -> int:
        """Fixed bytes of one sequence: every ring."""
        return sum(r.span * r.width * self._el(r.dtype) for r in self.spec.rings)

    def bytes_per_block(self) -> int:
        return sum(self.block_tokens // e.ratio * e.width * self._el(e.dtype) for e in self.spec.entries)

    def bytes_per_token(self) -> float:
        return self.bytes_per_block() / self.block_tokens

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens positions needs (0 when the model keeps no entries)."""
        return -(-num_tokens // self.block_tokens) if self.spec.entries else 0


class StatePools:
    """The pool tensors (on `device`) for `num_slots` sequences (+ scratch slot 0) and `num_blocks` entry blocks
    (+ scratch block 0); `max_blocks` = blocks of a max_model_len sequence."""

    def __init__(self, layout: PoolLayout, num_slots: int, num_blocks: int, max_model_len: int,
                 device: torch.device):
        self.layout, self.device = layout, device
        self.num_slots, self.num_blocks = num_slots, num_blocks
        self.block_tokens = layout.block_tokens
        self.max_blocks = max(layout.blocks_for(max_model_len), 1)
        S, dt = num_slots + 1, layout.dtype
        self.rings = {r.name: torch.zeros(S, r.span, r.width, dtype=torch_dtype(r.dtype, dt), device=device)
                      for r in layout.spec.rings}
        self.entries = {e.name: torch.zeros(num_blocks + 1, layout.block_tokens // e.ratio, e.width,
                                            dtype=torch_dtype(e.dtype, dt), device=device)
                        for e in layout.spec.entries}
        self.block_table = torch.zeros(S, self.max_blocks, dtype=torch.int32, device=device)

    def nbytes(self) -> int:
        tensors = [*self.rings.values(), *self.entries.values(), self.block_table]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- a sequence's slot-fixed state: what speculative rollback and prefix caching restore ----
    def snapshot(self, slot: int) -> dict[str, torch.Tensor]:
        """Copies of every ring row of `slot` (entries are append-only by position and need no copy)."""
        return {name: ring[slot].clone() for name, ring in self.rings.items()}

    def restore(self, slot: int, snapshot: dict[str, torch.Tensor]) -> None:
        if set(snapshot) != set(self.rings):
            raise DeepInferError("internal: a snapshot of another state layout was restored")
        for name, ring in self.rings.items():
            ring[slot].copy_(snapshot[name])
