"""The model contract: what the engine may call on a model, for every family alike.

The cache sizes its pools from `state_spec()`; the runner calls `forward` on a flat batch of rows over those pools
and `logits` on the rows it samples; speculation reads `drafting` (None: the checkpoint cannot draft) and calls
`draft`. Nothing else of a model is read outside engine/models/ (no attribute probing): a family declares what it
has here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import torch

from ..cache.forward_batch import ForwardBatch
from ..cache.spec import StateSpec


DRAFT_METHODS = ("dspark", "mtp")    # every family's DRAFT_METHOD (config/): what `speculative=` may name


@dataclass(frozen=True)
class Drafting:
    """How a model drafts: `method` ("dspark": V4.1's DSpark stages, one block per pass; "mtp": V4's NextN layer,
    one step per pass), `block_size` drafts one block proposes at most, `rings` the state rings the drafter reads,
    which the target's forward keeps current when the batch asks for it (ForwardBatch.draft_rings), `modules` the
    submodules that draft (under expert parallelism their MoE layers stay whole on every rank, so a draft block
    needs no collective)."""
    method: str
    block_size: int
    rings: tuple[str, ...]
    modules: tuple[str, ...] = ()


class Drafts(Protocol):
    tokens: torch.Tensor       # [R, k] drafts for positions p+2 .. p+k+1

    def acceptance_confidence(self) -> torch.Tensor:
        """[R, k] each draft's chance of acceptance as the model estimates it, in [0, 1]."""


@runtime_checkable
class CausalLM(Protocol):
    cfg: object
    drafting: Drafting | None
    checkpoint_dir: Path | None      # where its tokenizer.json lies (load_model sets it; None: built in memory)
    truncates_prefill: bool          # a last_only segment's rows before its end skip the upper layers (V4.1's YOCO)

    def state_spec(self) -> StateSpec:
        """Every per-sequence state the model keeps between steps (cache/spec.py)."""

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [N]: the step's rows (batch says whose and where) -> final hidden [N, D]. When the batch shares
        its rows over context-parallel ranks, input_ids and the result are this rank's rows only (batch.query_rows),
        and a layer that mixes positions reads every row's input through batch.all_rows."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, D] final hidden -> [M, vocab] fp32 logits."""

    def draft(self, pools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
              sample: Callable[[int, torch.Tensor], torch.Tensor], steps: int) -> Drafts:
        """Only when `drafting` is set: `steps` drafts per row r, sequence slot slots[r] [R] holding the target up to
        position positions[r] = p, tokens [R] the target's token for p+1; sample(i, logits [R, V]) draws draft i
        (position p+2+i). Static shapes (a CUDA graph can hold it)."""
