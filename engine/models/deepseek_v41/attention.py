"""V4.1 attention: every layer has its own sliding window of K=V latents; layers with ratio > 0 also
attend to their source group's shared compressed entries, masked to the latest index source's top-k.

Differences from V4: no per-head q RMSNorm; the window latent is FP8 (ue8m0 per 32) over all
channels, RoPE slice included; the compressed branch is produced by the group's KV source only
(see csa2.py) and handed to the later layers of the group through `ForwardBatch.shared`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.attention import sparse_sink_attention
from deepinfer.kernels.fake_quant import qat_fp8
from deepinfer.kernels.indexer import sparse_index_scores
from deepinfer.kernels.kv_formats import KVFormat
from deepinfer.kernels.rope import apply_rope

from ...cache.forward_batch import ForwardBatch
from ...cache.spec import Entries, Ring
from ...config.deepseek_v41 import DeepseekV41Config
from ..common.attention import LatentAttention
from ..common.pooled import open_windows, top_entries, window_source
from ..common.qat import index_record
from ..common.rope import RotaryEmbedding
from .csa2 import Compressor, Indexer, block_entries, candidate_block_mask, entry_record, quantize_entry

WINDOW_FP8_BLOCK = 32


def window_record(head_dim: int) -> KVFormat | None:
    """The release's cache record of a window latent: every channel e4m3 per 32, ue8m0 scales (528 B at 512)."""
    return KVFormat.fitting("fp8", head_dim, WINDOW_FP8_BLOCK)


class AttentionV41(LatentAttention):
    def __init__(self, cfg: DeepseekV41Config, layer: int, rope: RotaryEmbedding, rope_compress: RotaryEmbedding,
                 dtype: torch.dtype, qat_fake_quant: bool):
        super().__init__(cfg, cfg.sliding_window, dtype, qat_fake_quant)
        self.layer = layer
        self.rope, self.rope_compress = rope, rope_compress
        d = cfg.hidden_size
        self.ratio = cfg.compress_ratios[layer] if layer < cfg.num_hidden_layers else 0
        self.is_kv_source = layer in cfg.kv_source_layer_ids
        is_index_source = layer in cfg.index_source_layer_ids
        self.compressor = Compressor(d, self.head_dim, self.ratio, cfg.rms_norm_eps, dtype) \
            if self.is_kv_source else None
        self.indexer = Indexer(d, cfg.q_lora_rank, self.head_dim, cfg.index_n_heads, cfg.index_head_dim,
                               cfg.index_topk, self.is_kv_source, cfg.rms_norm_eps, dtype) \
            if is_index_source else None
        self.is_candidate_source = layer == cfg.candidate_source_layer_id
        self.uses_candidates = 0 <= cfg.candidate_source_layer_id < layer
        self.candidate_blocks, self.candidate_block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size

    def state_kinds(self) -> list:
        """What this layer keeps per sequence (cache/spec.py): its window ring; a KV source also its group's
        entries (+ index keys) and, at ratio > 1, the open group's buffers."""
        kinds = [Ring(f"{self.layer}.window", self.window, self.head_dim, packed=window_record(self.head_dim))]
        if self.compressor is not None:
            kinds.append(Entries(f"{self.layer}.kv", self.ratio, self.head_dim, packed=entry_record(self.head_dim)))
            if self.indexer is not None:
                kinds.append(Entries(f"{self.layer}.index", self.ratio, self.indexer.index_dim,
                                     packed=index_record(self.indexer.index_dim)))
            if self.ratio > 1:
                kinds += [Ring(f"{self.layer}.kv.pending_kv", self.ratio, self.head_dim, "accum"),
                          Ring(f"{self.layer}.kv.pending_score", self.ratio, self.head_dim, "accum")]
        return kinds

    # ---- shared projections ----
    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [Q, D] -> (q [Q, H, d] roped, qr [Q, q_lora] the low-rank residual the indexer reuses)."""
        qr = self.q_norm(self.wq_a(x))
        return apply_rope(self.wq_b(qr).view(x.shape[0], self.n_heads, self.head_dim), cos, sin), qr

    def window_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> K=V latents [N, d] as the window stores them (roped, FP8 QAT)."""
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return qat_fp8(kv, WINDOW_FP8_BLOCK) if self.qat_fake_quant else kv

    def forward(self, x: torch.Tensor, batch: ForwardBatch, qrows: torch.Tensor | None = None,
                query_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, D] normed input rows -> [Q, D] for the query rows `qrows` (None: every row); reads and writes the
        layer's pools in place. The source group's products pass from layer to layer in batch.shared; a
        selection is kept by the query rows' indices in the whole step (`query_rows`, None: every row), since
        YOCO-truncated layers see fewer rows than the layer that selected."""
        cos, sin = batch.rotary(self.rope)
        ring, kv = batch.pools.rings[f"{self.layer}.window"], self.window_kv(x, cos, sin)
        window = window_source(batch, ring, kv, self.window)
        x_in = x                                                  # the KV source compresses every input row
        if qrows is not None:
            x, cos, sin, window = x[qrows], cos[qrows], sin[qrows], (window[0], window[1][qrows])
        q, qr = self.queries(x, cos, sin)
        sources = [window]
        if self.ratio:
            sh = batch.shared
            if self.compressor is not None:
                self._publish_pooled(x_in, batch)
            if self.indexer is not None and sh.get("keys") is not None:
                self._select_pooled(self.indexer.queries(qr, x, cos, sin, self.qat_fake_quant), batch, qrows,
                                    query_rows)
            selected = _rows_of(sh.get("selected"), query_rows)
            if selected is not None:
                sources.append((sh["entries"], selected))
        out = sparse_sink_attention(q, sources, self.attn_sink, self.head_dim ** -0.5)
        batch.write_ring(ring, kv)                                 # after the attention read the ring in place
        return self.output(out, cos, sin)

    def _publish_pooled(self, x: torch.Tensor, batch: ForwardBatch) -> None:
        """KV source: every row closing a group pools it (from the pending rings and this step's rows) and writes
        entry p // r and its index key; the group's stores replace the previous group's in batch.shared."""
        pools, r, comp = batch.pools, self.ratio, self.compressor
        rows = batch.closing_rows(r)                                            # None: every row
        if comp.wgate is None:                                                  # ratio 1: every token is a group
            latents = comp.norm(comp.wkv(batch.picked(x, rows)))
        else:
            kv, gate = comp.project(x)                                          # [N, d] each, >= fp32
            latents = comp.pool(*open_windows(batch, f"{self.layer}.kv", kv, gate, rows), x.dtype)   # [C, r, d]
        entries, keys = self.compress(latents, batch.window_starts(rows, r))
        store = pools.entries[f"{self.layer}.kv"]
        batch.write_entries(store, rows, r, entries)
        sh = batch.shared
        sh.clear()
        sh["entries"], sh["per_block"] = store.flatten(0, 1), store.shape[1]
        sh["keys"] = None
        if keys is not None:
            key_store = pools.entries[f"{self.layer}.index"]
            batch.write_entries(key_store, rows, r, keys)
            sh["keys"] = key_store.flatten(0, 1)

    def _select_pooled(self, index_q: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch,
                       qrows: torch.Tensor | None, query_rows: torch.Tensor | None) -> None:
        """Index source: score the group's visible keys, keep the top-k (inside the candidates where they
        apply); the candidate source also publishes its candidate blocks. Long prefills go in row blocks
        (pooled.top_entries)."""
        sh = batch.shared
        positions = batch.positions if qrows is None else batch.positions[qrows]
        inside = _rows_of(sh.get("candidates"), query_rows) \
            if self.uses_candidates and not self.is_candidate_source else None
        published = []

        def score(index: torch.Tensor, span: slice) -> torch.Tensor:
            s = sparse_index_scores(index_q[0][span], index_q[1][span], sh["keys"], index,
                                    self.indexer.index_dim ** -0.5)                           # [R, J]
            if self.is_candidate_source:
                published.append(candidate_block_mask(s, positions[span], self.ratio, self.candidate_blocks,
                                                      self.candidate_block_size))                # [R, nb]
            elif inside is not None:
                s = s.masked_fill(~block_entries(inside[span], self.candidate_block_size, s.shape[1]), float("-inf"))
            return s

        selected = top_entries(batch, self.ratio, sh["per_block"], qrows, score, self.indexer.topk)
        at = _row_map(query_rows, batch.root_rows, selected.device)
        if self.is_candidate_source:
            sh["candidates"] = _Kept(torch.cat(published), at, False)
        sh["selected"] = _Kept(selected, at, -1)                                   # -1: no entry

    def compress(self, latents: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """KV source: pre-RoPE latents [n, d] of the groups starting at positions pos [n] (multiples of the ratio
        for rows closing a group; a static step's other rows go to scratch) -> (cache entries [n, d], index keys
        [n, dI] or None without an indexer), roped at pos."""
        entries = apply_rope(latents, *self.rope_compress(pos))
        if self.qat_fake_quant:
            entries = quantize_entry(entries)
        keys = None if self.indexer is None else self.indexer.keys(latents, pos, self.rope_compress,
                                                                   self.qat_fake_quant)
        return entries, keys

@dataclass
class _Kept:
    """A per-row product of some rows of the step: value [R, ...] for the step rows `at` maps to (at[i] = the row of
    value for step row i, -1: not kept; None: value has every row); `fill` stands for a row not kept."""
    value: torch.Tensor
    at: torch.Tensor | None
    fill: bool | int


def _row_map(query_rows: torch.Tensor | None, root_rows: int, device) -> torch.Tensor | None:
    """_Kept.at for products of the step rows query_rows [R] (None: every row): no [root_rows, ...] copy of the
    products, so a YOCO-truncated prefill of 128k rows keeps only the rows it selected for."""
    if query_rows is None:
        return None
    at = torch.full((root_rows,), -1, dtype=torch.long, device=device)
    at[query_rows] = torch.arange(query_rows.shape[0], device=device)
    return at


def _rows_of(kept: _Kept | None, query_rows: torch.Tensor | None) -> torch.Tensor | None:
    """The kept rows of the step rows query_rows (None: every row). A later layer's rows are a subset of the
    selecting layer's (YOCO truncates suffixes); a row that was not kept reads `fill` (no host sync either way)."""
    if kept is None:
        return None
    if kept.at is None:
        return kept.value if query_rows is None else kept.value[query_rows]
    at = kept.at if query_rows is None else kept.at[query_rows]
    got = kept.value[at.clamp(min=0)]
    return got.masked_fill((at < 0).view(-1, *[1] * (got.dim() - 1)), kept.fill)
