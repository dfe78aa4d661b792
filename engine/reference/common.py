"""What both reference forwards share: token chunks into one flat batch, and one sequence's window and visibility
rules over SequenceState tensors that grow by concatenation."""

from __future__ import annotations

import torch

from ..errors import DeepInferError
from .state import LayerState


def check_token_ids(model, input_ids: torch.Tensor) -> None:
    vocab = model.cfg.vocab_size
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise DeepInferError(f"token ids must lie in [0, {vocab}); got min {int(input_ids.min())}, "
                             f"max {int(input_ids.max())}: check the tokenizer matches the model")


def flat_chunks(model, token_chunks: list[torch.Tensor], states: list | None = None
                ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """[T_i] tensors (one per sequence state) -> (checked flat ids [N] on the model's device, their rows: sequence
    i owns rows chunks[i] = (start, end))."""
    if not len(token_chunks):
        raise DeepInferError("no token chunks given: pass one non-empty 1-D tensor of token ids per sequence")
    if states is not None:
        if len(states) != len(token_chunks):
            raise DeepInferError(f"got {len(token_chunks)} token chunks for {len(states)} sequence states; "
                                 f"pass one chunk per state")
        if len({id(s) for s in states}) != len(states):
            raise DeepInferError("the same sequence state appears twice in one batch; give each sequence "
                                 "one chunk per call")
    for i, c in enumerate(token_chunks):
        if not isinstance(c, torch.Tensor) or c.dim() != 1 or c.numel() == 0:
            shape = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            raise DeepInferError(f"token chunk {i} must be a non-empty 1-D tensor of token ids; got {shape}")
        if c.dtype.is_floating_point or c.dtype.is_complex or c.dtype == torch.bool:
            raise DeepInferError(f"token chunk {i} holds {c.dtype} values; token ids must be integers")
    ids = torch.cat(list(token_chunks)).long().to(model.device)
    check_token_ids(model, ids)
    bounds = torch.tensor([0] + [c.numel() for c in token_chunks]).cumsum(0).tolist()
    return ids, list(zip(bounds[:-1], bounds[1:]))


def batch_chunks(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """[B, T] -> (checked flat ids [B*T], one chunk per row) for a stateless full forward."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise DeepInferError(f"compute_logits takes input_ids of shape [B, T] with T >= 1; "
                             f"got {tuple(input_ids.shape)}")
    return flat_chunks(model, list(input_ids))


def window_keys(attn, state: LayerState, kv: torch.Tensor, kv_pos: torch.Tensor, prev_tokens: int,
                qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's sliding window of attention `attn`: its stored latents (the positions just before
    `prev_tokens`) followed by the new ones kv [T, d] at kv_pos -> (keys [K, d], visible [Tq, K] for queries at
    qpos: 0 <= p - k < window). Keeps the last window - 1 latents in `state`."""
    old = 0 if state.window is None else state.window.shape[0]
    keys = kv if state.window is None else torch.cat([state.window, kv])
    key_pos = torch.cat([torch.arange(prev_tokens - old, prev_tokens, device=kv.device), kv_pos])
    dist = qpos.unsqueeze(1) - key_pos.unsqueeze(0)
    visible = (dist >= 0) & (dist < attn.window)
    state.window = keys[max(keys.shape[0] - (attn.window - 1), 0):] if attn.window > 1 else keys[:0]
    return keys, visible


def visibility_bias(visible: torch.Tensor) -> torch.Tensor:
    """[..., K] bool -> the attention bias [..., K] fp32: 0 where visible, -inf where hidden."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible, float("-inf"))


def visible_entries(positions: torch.Tensor, num_entries: int, ratio: int) -> torch.Tensor:
    """[T, n] bool: entry w (pooling positions w*ratio .. w*ratio+ratio-1) is visible to the query at
    position p once its window closed, w < (p+1)//ratio."""
    entry = torch.arange(num_entries, device=positions.device)
    return entry.unsqueeze(0) < ((positions + 1) // ratio).unsqueeze(1)
