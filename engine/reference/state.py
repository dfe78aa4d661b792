"""Per-sequence decode state of the reference forwards: what each layer must remember between steps.

Tensors grow by concatenation here; the runtime's pooled allocator keeps the same fields in
preallocated pools. Everything is per sequence (no batch dimension).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """One compressor (main KV or indexer keys) of one layer.

    pending_*: the open window's tokens so far, [p < ratio, c*d] (c = 2 with overlap, else 1);
    pending_score holds gate + ape. prev_a_*: the A half (first d channels) of the last closed
    window, [ratio, d], which the next window's entry pools (overlapping CSA only).
    entries: every compressed entry emitted so far, [n, d], in final (normed, roped, QAT) form.
    """
    pending_kv: torch.Tensor | None = None
    pending_score: torch.Tensor | None = None
    prev_a_kv: torch.Tensor | None = None
    prev_a_score: torch.Tensor | None = None
    entries: torch.Tensor | None = None

    def num_entries(self) -> int:
        return 0 if self.entries is None else self.entries.shape[0]


@dataclass
class LayerState:
    window: torch.Tensor | None = None          # [<= window-1, d] the last K=V latents (DSpark rings: <= window)
    compressor: CompressorState | None = None   # CSA / HCA layers
    indexer: CompressorState | None = None      # CSA layers

    def nbytes(self) -> int:
        tensors = [self.window]
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                tensors += [comp.pending_kv, comp.pending_score, comp.prev_a_kv, comp.prev_a_score, comp.entries]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class SequenceState:
    """Everything a sequence carries between forward calls. `num_tokens` = tokens already processed."""
    layers: list[LayerState]
    mtp: list[LayerState] = field(default_factory=list)
    num_tokens: int = 0
    num_mtp_tokens: int = 0
    engram: torch.Tensor | None = None   # V4.1: the last (max_ngram-1) compressed ids (the engram's look-back)

    def nbytes(self) -> int:
        extra = 0 if self.engram is None else self.engram.numel() * self.engram.element_size()
        return sum(s.nbytes() for s in self.layers + self.mtp) + extra


def packed_kv_bytes_per_token(cfg) -> float:
    """V4.1 cached-state growth per token in the packed QAT layout (what a packed pool would store):
    per KV source and per entry, the FP4 latent (d/2 bytes + one e4m3 scale per 16) and the FP4 index
    key (dI/2 + one ue8m0 scale per 32), one entry every `ratio` tokens. 890 B for the release."""
    entry = cfg.head_dim // 2 + cfg.head_dim // 16 + cfg.index_head_dim // 2 + cfg.index_head_dim // 32
    return sum(entry / cfg.compress_ratios[s] for s in cfg.kv_source_layer_ids)
