"""What every model family's flat-batch entry points share: token-id checks and chunk bookkeeping.

A forward takes the new tokens of any number of sequences as one flat [N] tensor; sequence i owns
rows chunks[i] = (start, end)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DeepInferError


class FlatBatchLM(nn.Module):
    cfg: object

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size):
            raise DeepInferError(f"token ids must lie in [0, {self.cfg.vocab_size}); got min {int(input_ids.min())}, "
                                 f"max {int(input_ids.max())}: check the tokenizer matches the model")

    def flat_chunks(self, token_chunks: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """[T_i] tensors -> (checked flat ids [N] on the model's device, their (start, end) rows)."""
        ids = torch.cat([c.reshape(-1) for c in token_chunks]).to(self.device)
        self.check_token_ids(ids)
        bounds = torch.tensor([0] + [c.numel() for c in token_chunks]).cumsum(0).tolist()
        return ids, list(zip(bounds[:-1], bounds[1:]))

    def batch_chunks(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """[B, T] -> (checked flat ids [B*T], one chunk per row) for a stateless full forward."""
        if input_ids.dim() != 2:
            raise DeepInferError(f"compute_logits takes input_ids of shape [B, T]; got {tuple(input_ids.shape)}")
        return self.flat_chunks(list(input_ids))
