"""V4 attention: low-rank query, one shared K=V latent, sliding window + compressed entries, sinks,
inverse RoPE on the output, grouped low-rank output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.kernels.attention import sink_attention, sparse_sink_attention
from deepinfer.kernels.indexer import sparse_index_scores
from deepinfer.kernels.norm import rms_norm
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.rope import apply_rope

from ..cache.forward_batch import ForwardBatch
from ..cache.sequence_state import CompressorState, LayerState
from ..cache.spec import Entries, Ring
from ..config.deepseek_v4 import CSA, SLIDING, DeepseekV4Config
from . import qat
from .compressor import Compressor, Indexer
from .pooled import open_windows, top_entries, window_source
from .selection import visible_entries
from .layers import Linear, RMSNorm, fp32_param
from .rope import RotaryEmbedding


@dataclass
class SeqSlice:
    """Rows [start, end) of the flat token batch belong to one sequence whose state is `state`."""
    start: int
    end: int
    layers: list[LayerState]
    first_pos: int


def visibility_bias(visible: torch.Tensor) -> torch.Tensor:
    """[..., K] bool -> the attention bias [..., K] fp32: 0 where visible, -inf where hidden."""
    return torch.zeros(visible.shape, dtype=torch.float32, device=visible.device).masked_fill(~visible, float("-inf"))


class LatentAttention(nn.Module):
    """The projections V4 and V4.1 share: low-rank q (wq_a, q_norm, wq_b), one K=V latent (wkv, kv_norm),
    per-head sinks, and the grouped low-rank output (wo_a per group of heads, then wo_b)."""

    def __init__(self, cfg, window: int, dtype: torch.dtype, qat_fake_quant: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.window, self.eps, self.o_groups = window, cfg.rms_norm_eps, cfg.o_groups
        self.qat_fake_quant = qat_fake_quant
        d = cfg.hidden_size
        self.wq_a = Linear(d, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.wkv = Linear(d, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d, dtype)
        self.attn_sink = fp32_param(self.n_heads)

    def window_keys(self, state: LayerState, kv: torch.Tensor, kv_pos: torch.Tensor, prev_tokens: int,
                    qpos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's sliding window: its stored latents (the positions just before `prev_tokens`) followed
        by the new ones kv [T, d] at kv_pos -> (keys [K, d], visible [Tq, K] for queries at qpos: 0 <= p - k <
        window). Keeps the last window - 1 latents in `state`."""
        old = 0 if state.window is None else state.window.shape[0]
        keys = kv if state.window is None else torch.cat([state.window, kv])
        key_pos = torch.cat([torch.arange(prev_tokens - old, prev_tokens, device=kv.device), kv_pos])
        dist = qpos.unsqueeze(1) - key_pos.unsqueeze(0)
        visible = (dist >= 0) & (dist < self.window)
        state.window = keys[max(keys.shape[0] - (self.window - 1), 0):] if self.window > 1 else keys[:0]
        return keys, visible

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [N, H, d] -> [N, D]. K=V carried each key's rotation into the values: rotate back at the query
        position, then grouped wo_a (one [R, H*d/G] block per group of heads) and wo_b."""
        o = apply_rope(o, cos, sin, inverse=True)
        grouped = o.view(o.shape[0], self.o_groups, -1)                           # [N, G, H*d/G]
        return self.wo_b(self.wo_a.grouped(grouped).flatten(1))                   # wo_a: [G*R, H*d/G]


class Attention(LatentAttention):
    def __init__(self, cfg: DeepseekV4Config, layer_type: str, rope: RotaryEmbedding, dtype: torch.dtype,
                 qat_fake_quant: bool):
        super().__init__(cfg, cfg.sliding_window, dtype, qat_fake_quant)
        self.layer_type = layer_type
        self.rope = rope
        d = cfg.hidden_size
        self.ratio = 0 if layer_type == SLIDING else dict(cfg.compress_rates)[layer_type]
        self.compressor = None if layer_type == SLIDING else Compressor(
            d, self.head_dim, self.ratio, overlap=layer_type == CSA, eps=cfg.rms_norm_eps, dtype=dtype)
        self.indexer = None if layer_type != CSA else Indexer(
            d, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, self.ratio,
            cfg.rms_norm_eps, dtype)

    def new_state(self) -> LayerState:
        return LayerState(compressor=None if self.compressor is None else CompressorState(),
                          indexer=None if self.indexer is None else CompressorState())

    def state_kinds(self, layer: int) -> list:
        """What this layer keeps per sequence (cache/spec.py): its window ring; a compressor's entries and
        open-window buffers (two windows with overlap: the next entry pools the previous window's A halves); the
        indexer's keys and buffers."""
        latent = qat.latent_record(self.head_dim, self.rope_dim)
        kinds = [Ring(f"{layer}.window", self.window, self.head_dim, packed=latent)]
        for name, comp, width in ((f"{layer}.kv", self.compressor, self.head_dim),
                                  (f"{layer}.index", self.indexer and self.indexer.compressor,
                                   self.indexer and self.indexer.head_dim)):
            if comp is None:
                continue
            span, c = (2 if comp.overlap else 1) * comp.ratio, (2 if comp.overlap else 1) * width
            record = latent if name.endswith(".kv") else qat.index_record(width)
            kinds += [Entries(name, comp.ratio, width, packed=record), Ring(f"{name}.pending_kv", span, c, "accum"),
                      Ring(f"{name}.pending_score", span, c, "accum")]
        return kinds

    # ---- the runtime forward: every row of a step over the state pools ----
    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer: int) -> torch.Tensor:
        """x [N, D] normed input rows of a step -> [N, D]. Reads and writes the layer's pools in place."""
        pools = batch.pools
        q, kv, comp, idx, (cos, sin) = self.project(x, batch.rotary(self.rope))
        ring = pools.rings[f"{layer}.window"]
        sources = [window_source(batch, ring, kv, self.window)]
        if self.compressor is not None:
            store = pools.entries[f"{layer}.kv"]
            self._compress_pooled(self.compressor, *comp, batch, f"{layer}.kv", self._quantize_entry)
            if self.indexer is not None:
                index_kv, index_gate, index_q, index_w = idx
                self._compress_pooled(self.indexer.compressor, index_kv, index_gate, batch, f"{layer}.index",
                                      self._quantize_index)
                keys = pools.entries[f"{layer}.index"].flatten(0, 1)
                entries = top_entries(batch, self.ratio, store.shape[1], None, lambda index, span: (
                    sparse_index_scores(index_q[span], index_w[span], keys, index)), self.indexer.topk)   # [N, k]
            else:
                entries = batch.entry_index(self.ratio, store.shape[1])                # HCA: every visible one
            sources.append((store.flatten(0, 1), entries))
        out = sparse_sink_attention(q, sources, self.attn_sink, self.head_dim ** -0.5)
        batch.write_ring(ring, kv)                                 # after the attention read the ring in place
        return self.output(out, cos, sin)

    def _compress_pooled(self, comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, batch: ForwardBatch,
                         name: str, quantize) -> None:
        """One entry stream over the pools: kv, gate [N, c*d] (Compressor.project) of every row; each row that
        closes a window pools it (with overlap: the previous window's A halves first) into the stream's entry
        p // r. Rows of a window before this step come from the pending rings."""
        r, d = comp.ratio, comp.head_dim
        rows, valid = batch.closing_rows(r)
        win_kv, win_score = open_windows(batch, name, upcast(kv), comp.scores(gate, batch.positions), rows)
        prev_a = (win_kv[:, :r, :d], win_score[:, :r, :d]) if comp.overlap else None
        cur_kv, cur_score = (win_kv[:, r:], win_score[:, r:]) if comp.overlap else (win_kv, win_score)
        new = self.final_entries(comp.entries(cur_kv, cur_score, prev_a, batch.positions[rows] // r, self.rope),
                                 quantize)
        batch.write_entries(batch.pools.entries[name], rows, valid, r, new)

    # ---- the reference forward (the oracle): one SequenceState per sequence ----
    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSlice],
                          layer: int) -> torch.Tensor:
        """x: [N, D] normed block input of all sequences' new tokens; positions: [N]. Returns [N, D]."""
        q, kv, comp, idx, (cos, sin) = self.project(x, self.rope(positions))
        out = torch.empty_like(q)
        for s in seqs:
            rows = slice(s.start, s.end)
            out[rows] = self._attend_one(q[rows], kv[rows], positions[rows], s.first_pos, s.layers[layer],
                                         [t[rows] for t in comp], [t[rows] for t in idx])
        return self.output(out, cos, sin)

    def project(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """The per-token part, batched over every row: x [N, D], rotary = the rows' (cos, sin) -> (q [N, H, d] roped,
        kv [N, d] roped (+ QAT), comp = compressor (kv, gate) [N, c*d] each or (), idx = (index kv, index gate,
        index q [N, h, dI] (+ QAT), index weights [N, h]) or (), (cos, sin) [N, rd/2])."""
        n = x.shape[0]
        cos, sin = rotary
        qr = self.q_norm(self.wq_a(x))                                            # [N, q_lora]
        q = self.wq_b(qr).view(n, self.n_heads, self.head_dim)
        q = apply_rope(rms_norm(q, None, self.eps), cos, sin)                     # [N, H, d]
        kv = self.latent(x, rotary)                                               # [N, d]
        comp = idx = ()
        if self.compressor is not None:
            comp = self.compressor.project(x)                                    # kv, gate: [N, c*d] each
        if self.indexer is not None:
            index_q, index_w = self.indexer.queries(qr, x, cos, sin)
            idx = (*self.indexer.compressor.project(x), self._quantize_index(index_q), index_w)
        return q, kv, comp, idx, (cos, sin)

    def latent(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The K=V latent rows x [N, D] write into the window: [N, d], roped (+ QAT)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), *rotary)
        return qat.quantize_kv_latent(kv, self.rope_dim) if self.qat_fake_quant else kv

    def _attend_one(self, q, kv, positions, first_pos: int, state: LayerState, comp, idx) -> torch.Tensor:
        """One sequence's T new tokens: q [T, H, d], kv [T, d]; updates `state` in place."""
        keys, visible = self.window_keys(state, kv, positions, first_pos, positions)   # [K, d], [T, K]

        if self.compressor is not None:
            entries = self._append_entries(self.compressor.pool(*comp, first_pos, state.compressor, self.rope),
                                           state.compressor, self._quantize_entry)
            if self.indexer is not None:
                index_kv, index_gate, index_q, index_w = idx
                keys_i = self._append_entries(
                    self.indexer.compressor.pool(index_kv, index_gate, first_pos, state.indexer, self.rope),
                    state.indexer, self._quantize_index)
                shown = self.indexer.select(index_q, index_w, keys_i, positions)
            else:
                shown = visible_entries(positions, entries.shape[0], self.ratio)
            keys = torch.cat([keys, entries.to(keys.dtype)])
            visible = torch.cat([visible, shown], dim=1)
        return sink_attention(q, keys, visibility_bias(visible), self.attn_sink, self.head_dim ** -0.5)

    def _append_entries(self, new: torch.Tensor, state: CompressorState, quantize) -> torch.Tensor:
        new = self.final_entries(new, quantize)
        state.entries = new if state.entries is None else torch.cat([state.entries, new])
        return state.entries

    def final_entries(self, new: torch.Tensor, quantize) -> torch.Tensor:
        """Pooled entries [n, dim] (Compressor.entries) -> their stored form: compute dtype, then `quantize`
        (_quantize_entry for the KV stream, _quantize_index for the indexer keys)."""
        return quantize(new.to(self.wkv.dtype))

    def _quantize_entry(self, entries: torch.Tensor) -> torch.Tensor:
        return qat.quantize_kv_latent(entries, self.rope_dim) if self.qat_fake_quant else entries

    def _quantize_index(self, x: torch.Tensor) -> torch.Tensor:
        return qat.quantize_index(x) if self.qat_fake_quant else x
