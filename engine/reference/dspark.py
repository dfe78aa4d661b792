"""The DSpark oracle: the draft procedure of models/deepseek_v41/dspark.py over one SequenceState per sequence,
each stage's ring a tensor of the last `window` K=V latents (SequenceState.mtp[i].window)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepinfer.kernels.attention import sink_attention

from ..errors import DeepInferError
from ..models.common.layers import Linear
from ..models.deepseek_v41.dspark import DraftOutput, DSpark
from .state import SequenceState


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def observe(dspark: DSpark, features: torch.Tensor, positions: torch.Tensor, owners: list[int],
            states: list[SequenceState]) -> None:
    """Write the rings from target features at `positions` [S] (rows of sequence states[owners[i]],
    contiguous and ascending per sequence). Writing a position again replaces it (idempotent)."""
    main_x = dspark.main_x(features)
    rope = dspark.stages[0].attn.rope
    cos, sin = rope(positions)
    kv = [stage.attn.window_kv(main_x, cos, sin) for stage in dspark.stages]      # n x [S, d]
    for seq in sorted(set(owners)):
        rows = [i for i, o in enumerate(owners) if o == seq]
        _write(dspark, states[seq], [k[rows] for k in kv], int(positions[rows[0]]))


def check_write(dspark: DSpark, st: SequenceState, first: int, n: int) -> None:
    """Rings must stay contiguous: a write starts inside or right after what they hold, or refills a whole
    window. Checked before the target forward runs, so a refused call leaves the state untouched."""
    end = st.num_mtp_tokens
    held = 0 if st.mtp[0].window is None else st.mtp[0].window.shape[0]
    if (first > end and n < dspark.window) or first < end - held:
        have = "are empty" if not held else f"hold positions {end - held}..{end - 1}"
        raise DeepInferError(f"the DSpark rings of this sequence {have}; cannot write {n} rows from position "
                             f"{first}: send every token of a sequence through extend_and_draft (the rings "
                             f"are filled from the target's features)")


def _write(dspark: DSpark, st: SequenceState, kv: list[torch.Tensor], first: int) -> None:
    """Rows kv[i] [n, d] of positions first..first+n-1 go into stage i's ring (the last `window`)."""
    n = kv[0].shape[0]
    check_write(dspark, st, first, n)
    end, held = st.num_mtp_tokens, 0 if st.mtp[0].window is None else st.mtp[0].window.shape[0]
    for layer, new in zip(st.mtp, kv):
        old = layer.window[: held - max(end - first, 0)] if held and first <= end else new[:0]
        layer.window = torch.cat([old, new])[-dspark.window:]
    st.num_mtp_tokens = first + n


def draft(dspark: DSpark, embed: nn.Embedding, head: Linear, features: torch.Tensor, positions: torch.Tensor,
          tokens: torch.Tensor, states: list[SequenceState],
          sample: Callable[[torch.Tensor], torch.Tensor] = greedy, write: bool = True) -> DraftOutput:
    """One draft block per sequence. features [B, n_targets*D] at target positions [B] (= p),
    tokens [B] the target's sample for p+1. `sample` maps [B, V] fp32 logits to [B] tokens.
    write=False: the rings already hold position p (observe ran on the target's features)."""
    bsz, blk = tokens.shape[0], dspark.cfg.dspark_block_size
    if write:
        observe(dspark, features, positions, list(range(bsz)), states)
    h, pre, qpos = dspark.block_inputs(embed, tokens, positions)
    for i, stage in enumerate(dspark.stages):
        rings = [s.mtp[i] for s in states]
        h, pre = stage(h, pre, lambda x: _attend(stage.attn, x, qpos, rings, bsz, blk))
    return dspark.head_drafts(head, h, pre, tokens, bsz, blk, lambda i, lg: sample(lg))


def _attend(attn, x: torch.Tensor, qpos: torch.Tensor, rings, bsz: int, blk: int) -> torch.Tensor:
    """x [B*blk, D]: each sequence's block attends to its ring and to the whole block."""
    cos, sin = attn.rope(qpos)
    q, _ = attn.queries(x, cos, sin)                                              # [B*blk, H, d]
    kv = attn.window_kv(x, cos, sin)                                              # [B*blk, d]
    out = torch.empty_like(q)
    for b in range(bsz):
        rows = slice(b * blk, (b + 1) * blk)
        keys = torch.cat([rings[b].window, kv[rows]])
        bias = torch.zeros(blk, keys.shape[0], dtype=torch.float32, device=x.device)
        out[rows] = sink_attention(q[rows], keys, bias, attn.attn_sink, attn.head_dim ** -0.5)
    return attn.output(out, cos, sin)
