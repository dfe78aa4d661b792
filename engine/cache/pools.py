"""Preallocated decode-state pools: every state kind of every sequence lives in one fixed tensor per kind.

Two granularities:
  - per sequence slot (fixed size whatever the length): the sliding-window rings of every layer
    `window[l]` [S, W, d] (position p at ring row p % W), the compressors' open-window buffers
    `pending_kv/score[stream]` [S, r, width] (position p at row p % r), the overlapping compressors'
    previous A halves `prev_a_kv/score[stream]` [S, r, d], the engram look-back `engram` [S, n-1];
  - per block of `block_tokens` positions (grows with the sequence): the compressed entries of every
    entry stream `entries[stream]` [NB, block_tokens / ratio, dim]. One block table row per slot,
    `block_table` [S, max_blocks] int32, maps a sequence's block k (positions k*bt .. (k+1)*bt - 1) to a
    pool block; every stream shares it, each holding bt/ratio entries per block.

Slot 0 and block 0 are scratch: padding rows of a CUDA-graph batch and writes that must go nowhere
(a decode row whose compressor window did not close) land there. Entry j of a stream with ratio r
covers positions j*r .. j*r + r - 1 and lives at block_table[slot, j*r // bt], row j % (bt/r).

Stream names: "{layer}.kv" (main compressor / KV source entries) and "{layer}.index" (indexer keys).
V4: every compressed layer has "l.kv" (overlapping iff CSA) and CSA layers "l.index" (always overlapping,
own pending buffers). V4.1: each KV source has "l.kv" (pending iff ratio > 1, never overlapping) and,
when it publishes index keys, "l.index" (entries only: the keys come from the same latents).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import DeepInferError
from .sequence_state import CompressorState, SequenceState

MIN_BLOCK_TOKENS = 64
SCRATCH = 0


@dataclass(frozen=True)
class EntryStream:
    name: str
    layer: int
    ratio: int
    dim: int              # entry width (head_dim or index_head_dim)
    pending_width: int    # width of its open-window buffer; 0 = none of its own
    overlap: bool         # keeps the previous window's A halves (V4 CSA)
    field: str            # the LayerState attribute it mirrors: "compressor" or "indexer"


@dataclass(frozen=True)
class PoolLayout:
    """What one sequence's decode state needs, from the model config alone."""
    num_layers: int
    window: int
    head_dim: int
    streams: tuple[EntryStream, ...]
    block_tokens: int
    engram_lookback: int          # 0 = no engram
    dtype: torch.dtype            # windows and entries
    pending_dtype: torch.dtype    # compressor buffers (>= fp32)

    @classmethod
    def for_model(cls, model, block_tokens: int | None = None) -> "PoolLayout":
        """block_tokens: positions per entry block (default: MIN_BLOCK_TOKENS rounded up to a multiple of every
        compress ratio); a given value must be such a multiple."""
        cfg, dtype = model.cfg, model.dtype
        pending_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        d, di = cfg.head_dim, cfg.index_head_dim
        streams = []
        if cfg.model_type == "deepseek_v41":
            for layer in cfg.kv_source_layer_ids:
                r = cfg.compress_ratios[layer]
                streams.append(EntryStream(f"{layer}.kv", layer, r, d, d if r > 1 else 0, False, "compressor"))
                if model.layers[layer].attn.indexer is not None:
                    streams.append(EntryStream(f"{layer}.index", layer, r, di, 0, False, "indexer"))
            lookback = cfg.engram_max_ngram_size - 1 if cfg.engram_layer_ids else 0
        else:
            for layer, attn in enumerate(b.attn for b in model.layers):
                if attn.compressor is not None:
                    c = 2 if attn.compressor.overlap else 1
                    streams.append(EntryStream(f"{layer}.kv", layer, attn.ratio, d, c * d, attn.compressor.overlap,
                                               "compressor"))
                if attn.indexer is not None:
                    streams.append(EntryStream(f"{layer}.index", layer, attn.ratio, di, 2 * di, True, "indexer"))
            lookback = 0
        ratios = [s.ratio for s in streams] or [1]
        lcm = math.lcm(*ratios)
        if block_tokens is None:
            block_tokens = lcm * math.ceil(MIN_BLOCK_TOKENS / lcm)
        elif block_tokens < 1 or block_tokens % lcm:
            raise DeepInferError(f"block_size={block_tokens} must be a positive multiple of {lcm} (every compress "
                                 f"ratio of this model divides a block)")
        return cls(cfg.num_hidden_layers, cfg.sliding_window, d, tuple(streams), block_tokens, lookback, dtype,
                   pending_dtype)

    # ---- sizes ----
    def bytes_per_slot(self) -> int:
        """Fixed bytes of one sequence: windows, compressor buffers, engram look-back."""
        el, pel = _elsize(self.dtype), _elsize(self.pending_dtype)
        n = self.num_layers * self.window * self.head_dim * el
        for s in self.streams:
            n += 2 * s.ratio * s.pending_width * pel
            n += 2 * s.ratio * s.dim * pel if s.overlap else 0
        return n + self.engram_lookback * 8

    def bytes_per_block(self) -> int:
        el = _elsize(self.dtype)
        return sum(self.block_tokens // s.ratio * s.dim * el for s in self.streams)

    def bytes_per_token(self) -> float:
        return self.bytes_per_block() / self.block_tokens

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of num_tokens positions needs (0 when the model has no entry streams)."""
        return -(-num_tokens // self.block_tokens) if self.streams else 0


def _elsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class StatePools:
    """The pool tensors (on the model's device) for `num_slots` sequences (+ scratch slot 0) and `num_blocks`
    entry blocks (+ scratch block 0); `max_blocks` = blocks of a max_model_len sequence."""

    def __init__(self, layout: PoolLayout, num_slots: int, num_blocks: int, max_model_len: int,
                 device: torch.device):
        self.layout, self.device = layout, device
        self.num_slots, self.num_blocks = num_slots, num_blocks
        self.max_blocks = max(layout.blocks_for(max_model_len), 1)
        S, W, L = num_slots + 1, layout.window, layout.num_layers
        dt, pdt = layout.dtype, layout.pending_dtype
        self.window = [torch.zeros(S, W, layout.head_dim, dtype=dt, device=device) for _ in range(L)]
        self.pending_kv, self.pending_score, self.prev_a_kv, self.prev_a_score, self.entries = {}, {}, {}, {}, {}
        for s in layout.streams:
            if s.pending_width:
                self.pending_kv[s.name] = torch.zeros(S, s.ratio, s.pending_width, dtype=pdt, device=device)
                self.pending_score[s.name] = torch.zeros(S, s.ratio, s.pending_width, dtype=pdt, device=device)
            if s.overlap:
                self.prev_a_kv[s.name] = torch.zeros(S, s.ratio, s.dim, dtype=pdt, device=device)
                self.prev_a_score[s.name] = torch.zeros(S, s.ratio, s.dim, dtype=pdt, device=device)
            self.entries[s.name] = torch.zeros(num_blocks + 1, layout.block_tokens // s.ratio, s.dim, dtype=dt,
                                               device=device)
        self.engram = torch.zeros(S, max(layout.engram_lookback, 1), dtype=torch.int64, device=device)
        self.block_table = torch.zeros(S, self.max_blocks, dtype=torch.int32, device=device)
        # Host copy of how many table columns each slot owns (None: not tracked, e.g. tables filled by hand).
        self.slot_blocks: list[int | None] = [None] * S

    def nbytes(self) -> int:
        tensors = [*self.window, *self.pending_kv.values(), *self.pending_score.values(), *self.prev_a_kv.values(),
                   *self.prev_a_score.values(), *self.entries.values(), self.engram, self.block_table]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- between the pools and the reference path's SequenceState ----
    def load_state(self, slot: int, num_tokens: int, state: SequenceState) -> SequenceState:
        """Fill a fresh `state` (model.new_state()) with what the pools hold for a sequence of num_tokens
        positions in `slot`; the reference forward then continues it."""
        lay, W = self.layout, self.layout.window
        state.num_tokens = num_tokens
        if num_tokens == 0:
            return state
        keep = min(W - 1, num_tokens)
        if keep:
            rows = torch.arange(num_tokens - keep, num_tokens, device=self.device) % W
            for layer, st in enumerate(state.layers):
                st.window = self.window[layer][slot, rows].clone()
        for s in lay.streams:
            comp: CompressorState = getattr(state.layers[s.layer], s.field)
            n = num_tokens // s.ratio
            comp.entries = self._gather_entries(s, slot, n)
            p = num_tokens % s.ratio
            if s.pending_width:
                rows = torch.arange(num_tokens - p, num_tokens, device=self.device) % s.ratio
                comp.pending_kv = self.pending_kv[s.name][slot, rows].clone()
                comp.pending_score = self.pending_score[s.name][slot, rows].clone()
            if s.overlap and n:
                comp.prev_a_kv = self.prev_a_kv[s.name][slot].clone()
                comp.prev_a_score = self.prev_a_score[s.name][slot].clone()
        if lay.engram_lookback:
            state.engram = self.engram[slot].clone()
        return state

    def store_state(self, slot: int, state: SequenceState, from_tokens: int) -> None:
        """Write back what a reference forward added to a sequence that entered it with from_tokens positions."""
        lay, W, n_tok = self.layout, self.layout.window, state.num_tokens
        keep = min(W - 1, n_tok)
        for layer, st in enumerate(state.layers):
            if keep and st.window is not None and st.window.shape[0]:
                win = st.window[-keep:]
                rows = torch.arange(n_tok - win.shape[0], n_tok, device=self.device) % W
                self.window[layer][slot, rows] = win.to(lay.dtype)
        for s in lay.streams:
            comp: CompressorState = getattr(state.layers[s.layer], s.field)
            first = from_tokens // s.ratio
            if comp.entries is not None and comp.entries.shape[0] > first:
                self._scatter_entries(s, slot, first, comp.entries[first:])
            if s.pending_width and comp.pending_kv is not None and comp.pending_kv.shape[0]:
                p = comp.pending_kv.shape[0]
                rows = torch.arange(n_tok - p, n_tok, device=self.device) % s.ratio
                self.pending_kv[s.name][slot, rows] = comp.pending_kv.to(lay.pending_dtype)
                self.pending_score[s.name][slot, rows] = comp.pending_score.to(lay.pending_dtype)
            if s.overlap and comp.prev_a_kv is not None:
                self.prev_a_kv[s.name][slot] = comp.prev_a_kv.to(lay.pending_dtype)
                self.prev_a_score[s.name][slot] = comp.prev_a_score.to(lay.pending_dtype)
        if lay.engram_lookback and state.engram is not None:
            self.engram[slot] = state.engram

    def entry_location(self, s: EntryStream, slot: int, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool blocks, rows) of entries first .. first+count-1 of `slot` in stream s."""
        per_block = self.layout.block_tokens // s.ratio
        j = torch.arange(first, first + count, device=self.device)
        return self.block_table[slot, j // per_block].long(), j % per_block

    def _gather_entries(self, s: EntryStream, slot: int, n: int) -> torch.Tensor | None:
        if n == 0:
            return None
        blocks, rows = self.entry_location(s, slot, 0, n)
        return self.entries[s.name][blocks, rows].clone()

    def _scatter_entries(self, s: EntryStream, slot: int, first: int, new: torch.Tensor) -> None:
        owned = self.slot_blocks[slot]
        last_block = ((first + new.shape[0]) * s.ratio - 1) // self.layout.block_tokens
        if owned is not None and last_block >= owned:
            raise DeepInferError(f"internal: slot {slot} writes block {last_block} but owns {owned} blocks")
        blocks, rows = self.entry_location(s, slot, first, new.shape[0])
        self.entries[s.name][blocks, rows] = new.to(self.layout.dtype)


def ring_window(ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token per row: write kv [B, d] at ring row p % W of ring [S, W, d]; return the keys [B, W, d]
    at positions p-W+1 .. p (oldest first) and which of them exist [B, W] (position >= 0)."""
    width = ring.shape[1]
    ring[slots, positions % width] = kv.to(ring.dtype)
    key_pos = positions.unsqueeze(1) - (width - 1) + torch.arange(width, device=kv.device)     # [B, W]
    return ring[slots.unsqueeze(1), key_pos % width], key_pos >= 0
