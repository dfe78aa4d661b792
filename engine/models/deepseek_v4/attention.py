"""V4 attention: low-rank query, one shared K=V latent, sliding window + compressed entries (CSA with the lightning
indexer's top-k, HCA all visible), sinks, inverse RoPE on the output, grouped low-rank output projection."""

from __future__ import annotations

import torch

from deepinfer.kernels.attention import sparse_sink_attention
from deepinfer.kernels.indexer import sparse_index_scores
from deepinfer.kernels.norm import rms_norm
from deepinfer.kernels.precision import upcast
from deepinfer.kernels.rope import apply_rope

from ...cache.forward_batch import ForwardBatch
from ...cache.spec import Entries, Ring
from ...config.deepseek_v4 import CSA, SLIDING, DeepseekV4Config
from ..common import qat
from ..common.attention import LatentAttention
from ..common.pooled import open_windows, top_entries, window_source
from ..common.rope import RotaryEmbedding
from .compressor import Compressor, Indexer


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

    def forward(self, x: torch.Tensor, batch: ForwardBatch, layer: int, qrows: torch.Tensor | None = None
                ) -> torch.Tensor:
        """x [N, D] normed input rows of a step -> [Q, D] for the query rows qrows [Q] of the step (None: every
        row). Reads and writes the layer's pools in place; the state is written from every row. NOTE: qrows is the
        hook context-parallel prefill needs (parallel/context_parallel.py): each rank asks only its own positions
        while the whole sequence's state is written, as V4.1's YOCO truncation asks its suffix."""
        pools = batch.pools
        cos, sin = batch.rotary(self.rope)
        kv, comp, idx = self.state_projections(x, (cos, sin))
        if qrows is not None:
            x, cos, sin = x[qrows], cos[qrows], sin[qrows]
        q, (index_q, index_w) = self.query_projections(x, (cos, sin))
        ring = pools.rings[f"{layer}.window"]
        window, index = window_source(batch, ring, kv, self.window)
        sources = [(window, index if qrows is None else index[qrows])]
        if self.compressor is not None:
            store = pools.entries[f"{layer}.kv"]
            self._compress_pooled(self.compressor, *comp, batch, f"{layer}.kv", self.quantize_entry)
            if self.indexer is not None:
                self._compress_pooled(self.indexer.compressor, *idx, batch, f"{layer}.index", self.quantize_index)
                keys = pools.entries[f"{layer}.index"].flatten(0, 1)
                entries = top_entries(batch, self.ratio, store.shape[1], qrows, lambda index, span: (
                    sparse_index_scores(index_q[span], index_w[span], keys, index)), self.indexer.topk)   # [Q, k]
            elif qrows is None:
                entries = batch.entry_index(self.ratio, store.shape[1])                # HCA: every visible one
            else:
                entries = batch.entry_index_of(self.ratio, store.shape[1], qrows)
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
        rows = batch.closing_rows(r)                                            # None: every row
        win_kv, win_gate = open_windows(batch, name, upcast(kv), upcast(gate), rows)   # ape: Compressor.entries
        prev_a = (win_kv[:, :r, :d], win_gate[:, :r, :d]) if comp.overlap else None
        cur_kv, cur_gate = (win_kv[:, r:], win_gate[:, r:]) if comp.overlap else (win_kv, win_gate)
        new = self.final_entries(comp.entries(cur_kv, cur_gate, prev_a, batch.window_starts(rows, r), self.rope),
                                 quantize)
        batch.write_entries(batch.pools.entries[name], rows, r, new)

    def project(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """The per-token part, batched over every row: x [N, D], rotary = the rows' (cos, sin) -> (q [N, H, d] roped,
        kv [N, d] roped (+ QAT), comp = compressor (kv, gate) [N, c*d] each or (), idx = (index kv, index gate,
        index q [N, h, dI] (+ QAT), index weights [N, h]) or (), (cos, sin) [N, rd/2])."""
        kv, comp, idx = self.state_projections(x, rotary)
        q, index_q = self.query_projections(x, rotary)
        return q, kv, comp, (*idx, *index_q) if idx else (), rotary

    def state_projections(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """What every row writes into the state: x [N, D] -> (kv [N, d] roped (+ QAT), compressor (kv, gate)
        [N, c*d] each or (), indexer compressor (kv, gate) or ())."""
        kv = self.latent(x, rotary)                                               # [N, d]
        comp = self.compressor.project(x) if self.compressor is not None else ()  # kv, gate: [N, c*d] each
        idx = self.indexer.compressor.project(x) if self.indexer is not None else ()
        return kv, comp, idx

    def query_projections(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]):
        """What only the query rows need: x [Q, D] -> (q [Q, H, d] roped, (index q [Q, h, dI] (+ QAT), index
        weights [Q, h]) or (None, None) without an indexer)."""
        cos, sin = rotary
        qr = self.q_norm(self.wq_a(x))                                            # [Q, q_lora]
        q = self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim)
        q = apply_rope(rms_norm(q, None, self.eps), cos, sin)                     # [Q, H, d]
        if self.indexer is None:
            return q, (None, None)
        index_q, index_w = self.indexer.queries(qr, x, cos, sin)
        return q, (self.quantize_index(index_q), index_w)

    def latent(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The K=V latent rows x [N, D] write into the window: [N, d], roped (+ QAT)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), *rotary)
        return qat.quantize_kv_latent(kv, self.rope_dim) if self.qat_fake_quant else kv

    def final_entries(self, new: torch.Tensor, quantize) -> torch.Tensor:
        """Pooled entries [n, dim] (Compressor.entries) -> their stored form: compute dtype, then `quantize`
        (quantize_entry for the KV stream, quantize_index for the indexer keys)."""
        return quantize(new.to(self.wkv.dtype))

    def quantize_entry(self, entries: torch.Tensor) -> torch.Tensor:
        return qat.quantize_kv_latent(entries, self.rope_dim) if self.qat_fake_quant else entries

    def quantize_index(self, x: torch.Tensor) -> torch.Tensor:
        return qat.quantize_index(x) if self.qat_fake_quant else x
