"""The oracle: each model family's forward over one SequenceState per sequence, written for clarity (tensors grow
by concatenation, every sequence attends on its own), which the runtime forward over the state pools is tested
against. Only tests and the checkpoint tools import it (router calibration of random models, parity scripts); the
engine never does.

    state = new_state(model)
    logits = extend(model, [tokens], [state])[0]          # [T, vocab], the state advanced
    full = compute_logits(model, ids)                     # [B, T] -> [B, T, vocab], stateless
    y, target_logits, drafts = extend_and_draft(model, [tokens], [state])   # V4.1 with DSpark stages
"""

from __future__ import annotations

import torch

from ..errors import DeepInferError
from . import dspark, v4, v41
from .common import batch_chunks, flat_chunks
from .state import CompressorState, LayerState, SequenceState, packed_kv_bytes_per_token

FAMILIES = {"deepseek_v4": v4, "deepseek_v41": v41}


def _family(model):
    return FAMILIES[model.cfg.model_type]


def new_state(model) -> SequenceState:
    """An empty per-sequence state for `model` (every layer's, and its draft layers')."""
    return _family(model).new_state(model)


def forward_reference(model, input_ids: torch.Tensor, chunks: list[tuple[int, int]], states: list[SequenceState],
                      **options):
    """input_ids [N]: new tokens of len(states) sequences, sequence i owning rows chunks[i] = (start, end); advances
    each state. V4: the last streams [N, hc, D]; V4.1: v41.ForwardOutput (options last_only, feature_window)."""
    return _family(model).forward_reference(model, input_ids, chunks, states, **options)


@torch.inference_mode()
def compute_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Stateless full forward: input_ids [B, T] -> logits [B, T, vocab] fp32 (the parity hook)."""
    ids, chunks = batch_chunks(model, input_ids)
    return _all_logits(model, ids, chunks, [new_state(model) for _ in chunks]).view(*input_ids.shape, -1)


@torch.inference_mode()
def extend(model, token_chunks: list[torch.Tensor], states: list[SequenceState],
           last_only: bool = False) -> list[torch.Tensor]:
    """Incremental forward: append token_chunks[i] ([T_i]) to sequence i; return each chunk's logits [T_i, V]
    (last_only, V4.1: [1, V], computed with YOCO truncation)."""
    ids, chunks = flat_chunks(model, token_chunks, states)
    if last_only:
        out = v41.forward_reference(model, ids, chunks, states, last_only=True)
        logits = model.logits(out.hidden)
        return [logits[i:i + 1] for i in _last_rows(out.rows, chunks).tolist()]
    logits = _all_logits(model, ids, chunks, states)
    return [logits[s:e] for s, e in chunks]


def _all_logits(model, ids, chunks, states) -> torch.Tensor:
    return _family(model).all_logits(model, ids, chunks, states)


@torch.inference_mode()
def extend_and_draft(model, token_chunks: list[torch.Tensor], states: list[SequenceState], sample=dspark.greedy
                     ) -> tuple[torch.Tensor, torch.Tensor, object]:
    """V4.1: append token_chunks[i] to sequence i (YOCO-truncated), sample the next token y_i from the
    last position p_i, fill the DSpark rings and draft a block after y_i.
    Returns (y [B], target logits at p [B, V], drafts for p+2 ..)."""
    if model.dspark is None:
        raise DeepInferError("this model has no DSpark draft stages (num_nextn_predict_layers = 0)")
    ids, chunks = flat_chunks(model, token_chunks, states)
    w = model.cfg.sliding_window
    for (s, e), st in zip(chunks, states):
        dspark.check_write(model.dspark, st, st.num_tokens + max(0, e - s - w), min(e - s, w))
    out = v41.forward_reference(model, ids, chunks, states, last_only=True, feature_window=w)
    logits = model.logits(out.hidden[_last_rows(out.rows, chunks)])
    tokens = sample(logits)
    # feature rows -> (owner sequence, absolute position)
    owner = torch.bucketize(out.feature_rows, torch.tensor([e for _, e in chunks], device=model.device), right=True)
    first_pos = torch.tensor([st.num_tokens - (e - s) - s for (s, e), st in zip(chunks, states)],
                             device=model.device)
    positions = out.feature_rows + first_pos[owner]
    dspark.observe(model.dspark, out.features, positions, owner.tolist(), states)
    last = _last_rows(out.feature_rows, chunks)
    drafts = dspark.draft(model.dspark, model.embed, model.head, out.features[last], positions[last], tokens, states,
                          sample, write=False)
    return tokens, logits, drafts


def _last_rows(rows: torch.Tensor, chunks) -> torch.Tensor:
    """Index of each chunk's last input row within `rows` (output or feature row indices)."""
    ends = torch.tensor([e - 1 for _, e in chunks], device=rows.device)
    return (rows.unsqueeze(0) == ends.unsqueeze(1)).float().argmax(dim=1)


def mtp_forward(model, streams: torch.Tensor, next_ids: torch.Tensor, chunks: list[tuple[int, int]],
                states: list[SequenceState], depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """V4: the NextN layer mtp.{depth} on the target's streams (v4.mtp_forward)."""
    return v4.mtp_forward(model, streams, next_ids, chunks, states, depth)


__all__ = ["CompressorState", "LayerState", "SequenceState", "batch_chunks", "compute_logits", "extend",
           "extend_and_draft", "flat_chunks", "forward_reference", "mtp_forward", "new_state",
           "packed_kv_bytes_per_token"]
