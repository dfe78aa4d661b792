"""What both model families build alike: the config, the two ropes and the token embedding. A forward takes the new
tokens of any number of sequences as one flat [N] tensor (cache/forward_batch.py says whose rows are whose)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from .rope import RotaryEmbedding


class FlatBatchLM(nn.Module):
    cfg: object
    checkpoint_dir: Path | None = None    # load_model sets it: the tokenizer.json the engine reads
    truncates_prefill = False             # last_only pieces run on a suffix (a family that can says so)

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

    def layer_depths(self, engram_layers=(), lookback: int = 0) -> tuple[list[int], int]:
        """How far back each layer's input reaches through the layers below (cache/spec.py's Ring.depth): depth[l] of
        layer l's input (after an engram at l, which reads `lookback` earlier tokens), and the final streams'. Each
        sliding-window attention reaches window - 1 positions back; compressed entries and index keys are
        per-position state a prefix hit keeps, so they add nothing."""
        depths, depth = [], 0
        for layer in range(self.cfg.num_hidden_layers):
            if layer in engram_layers:
                depth = max(depth, lookback)
            depths.append(depth)
            depth += self.cfg.sliding_window - 1
        return depths, depth
