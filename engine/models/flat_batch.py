"""What every model family's flat-batch entry points share: token-id checks and chunk bookkeeping.

A forward takes the new tokens of any number of sequences as one flat [N] tensor; sequence i owns
rows chunks[i] = (start, end)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import DeepInferError
from .rope import RotaryEmbedding


class FlatBatchLM(nn.Module):
    cfg: object

    def init_common(self, cfg, dtype: torch.dtype, qat_fake_quant: bool) -> None:
        """Config, the two ropes (main: sliding-only layers; compress: YaRN, layers with a compressed branch)
        and the token embedding, which both families build alike."""
        self.cfg, self.dtype, self.qat_fake_quant = cfg, dtype, qat_fake_quant
        rd = cfg.qk_rope_head_dim
        self.rope_main = RotaryEmbedding(rd, cfg.rope_theta, None)
        self.rope_compress = RotaryEmbedding(rd, cfg.compress_rope_theta, cfg.rope_scaling)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed.weight.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.cfg.vocab_size):
            raise DeepInferError(f"token ids must lie in [0, {self.cfg.vocab_size}); got min {int(input_ids.min())}, "
                                 f"max {int(input_ids.max())}: check the tokenizer matches the model")

    def flat_chunks(self, token_chunks: list[torch.Tensor], states: list | None = None
                    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """[T_i] tensors (one per sequence state) -> (checked flat ids [N] on the model's device, their rows)."""
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
        ids = torch.cat(list(token_chunks)).long().to(self.device)
        self.check_token_ids(ids)
        bounds = torch.tensor([0] + [c.numel() for c in token_chunks]).cumsum(0).tolist()
        return ids, list(zip(bounds[:-1], bounds[1:]))

    def batch_chunks(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """[B, T] -> (checked flat ids [B*T], one chunk per row) for a stateless full forward."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise DeepInferError(f"compute_logits takes input_ids of shape [B, T] with T >= 1; "
                                 f"got {tuple(input_ids.shape)}")
        return self.flat_chunks(list(input_ids))
