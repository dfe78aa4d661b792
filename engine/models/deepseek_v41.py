"""DeepSeek-V4.1 (Flash) text model, module and parameter names as in DeepSeek's checkpoint.

Top level: embed -> hc_mult copies -> 40 blocks -> collapse with the last site's `pre` -> norm -> head.
Single-pass mHC: one projection per site gives (pre, post, comb); post/comb act at their own site,
`pre` collapses the streams for the *next* site (layer 0's attention collapses stream 0):
  [h = engram(h)]                                   (engram layers)
  pre_a, post, comb = mixes(h);  h = hc_post(attn(attn_norm(collapse(h, pre_mix))), h, post, comb)
  pre_f, post, comb = mixes(h);  h = hc_post(ffn(ffn_norm(collapse(h, pre_a))), h, post, comb)
  pre_mix = pre_f

YOCO prefill truncation (`last_only`): from the last KV source on, a layer mixes positions only
through its own window, so the last token's logits need layer l's outputs on the suffix
[t - (L-1-l)(W-1), t] only (L layers, window W). Each layer therefore runs its queries, attention
output and MoE on that shrinking suffix; its window KV comes from its (one step longer) input
suffix, and the last KV source still compresses every token. Exact, and it leaves every window
state as a full prefill would (docs/model-v41.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..cache.forward_batch import ForwardBatch
from ..cache.sequence_state import LayerState, SequenceState
from ..cache.spec import Ring, StateSpec
from ..config.deepseek_v41 import DeepseekV41Config
from ..errors import DeepInferError
from .attention_v41 import AttentionV41, SeqRows
from .dspark import DSpark, DraftOutput, build_stages, greedy
from .flat_batch import FlatBatchLM
from .engram import BLOCKED, Engram, EngramHasher
from .layers import Linear, RMSNorm
from .mhc import HyperConnectionSites, hc_collapse, hc_post
from .moe import MoE, Gate
from .rope import RotaryEmbedding


class BlockV41(HyperConnectionSites):
    def __init__(self, cfg: DeepseekV41Config, layer: int, rope: RotaryEmbedding, rope_compress: RotaryEmbedding,
                 dtype: torch.dtype, qat_fake_quant: bool, n_experts: int, top_k: int, expert_storage: str = "dense"):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.attn = AttentionV41(cfg, layer, rope, rope_compress, dtype, qat_fake_quant)
        gate = Gate(d, n_experts, top_k, cfg.scoring_func, cfg.routed_scaling_factor, dtype, temp=cfg.gate_temp,
                    bias_vl=True, normalize=cfg.norm_topk_prob)
        self.ffn = MoE(gate, d, cfg.moe_intermediate_size, cfg.n_shared_experts, cfg.swiglu_limit, dtype,
                       expert_storage)
        self.engram = Engram(cfg, layer, dtype, cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)]) \
            if layer in cfg.engram_layer_ids else None
        self.init_sites(cfg)

    def forward(self, h: torch.Tensor, pre_mix: torch.Tensor, attend, qrows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [I, hc, D] streams (after any engram), pre_mix [I, hc]; attend(x [I, D] normed) -> [Q, D] runs the
        attention. Returns (streams, next pre) on the query rows `qrows` (None: all rows)."""
        x = attend(self.attn_norm(hc_collapse(h, pre_mix)))
        if qrows is not None:
            h = h[qrows]
        pre_a, post, comb = self.mixes(h, "attn")
        h = hc_post(x, h, post, comb)
        pre_f, post, comb = self.mixes(h, "ffn")
        h = hc_post(self.ffn(self.ffn_norm(hc_collapse(h, pre_a))), h, post, comb)
        return h, pre_f


@dataclass
class ForwardOutput:
    hidden: torch.Tensor                  # [M, D] final normed hidden of the output rows
    rows: torch.Tensor                    # [M] their indices into the input rows
    features: torch.Tensor | None = None  # [F, n_targets*D] DSpark target features
    feature_rows: torch.Tensor | None = None


class DeepseekV41ForCausalLM(FlatBatchLM):
    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype = torch.float32, qat_fake_quant: bool = True,
                 expert_storage: str = "dense"):
        """expert_storage="fp4": routed experts stay FP4-packed and dequantize per use (moe.Experts)."""
        super().__init__()
        self.init_common(cfg, dtype, qat_fake_quant)
        self.layers = nn.ModuleList(
            BlockV41(cfg, i, self.rope_compress if cfg.compress_ratios[i] else self.rope_main, self.rope_compress,
                     dtype, qat_fake_quant, cfg.n_routed_experts, cfg.num_experts_per_tok, expert_storage)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.hasher: EngramHasher | None = None   # bound from the tokenizer (bind_tokenizer)
        if cfg.num_nextn_predict_layers:
            self.mtp = build_stages(cfg, self.rope_main, dtype, qat_fake_quant, expert_storage)
            self.dspark = DSpark(cfg, self.mtp)

    def new_state(self) -> SequenceState:
        return SequenceState(layers=[b.attn.new_state() for b in self.layers],
                             mtp=[LayerState() for _ in getattr(self, "mtp", ())])

    def bind_tokenizer(self, tokenizer) -> None:
        """Build the engram hash tables from the tokenizer (checks the compressed vocabulary size)."""
        if self.cfg.engram_layer_ids:
            self.hasher = EngramHasher.from_tokenizer(self.cfg, tokenizer)

    def state_spec(self) -> StateSpec:
        """Every layer's state, the engram look-back (the compressed ids of the last max_ngram - 1 positions) and
        one ring per DSpark stage (K=V latents of the target features, one window)."""
        kinds = [k for b in self.layers for k in b.attn.state_kinds()]
        if self.cfg.engram_layer_ids:
            kinds.append(Ring("engram", self.cfg.engram_max_ngram_size - 1, 1, "int64"))
        kinds += [Ring(f"mtp.{i}.window", self.cfg.sliding_window, self.cfg.head_dim)
                  for i in range(len(getattr(self, "mtp", ())))]
        return StateSpec.of(kinds)

    # ---- the runtime forward ----
    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [N]: the step's rows (batch says whose and where) -> final hidden [N, D]. Segments marked
        last_only run YOCO-truncated (module docstring): their rows before the last one come back as zeros."""
        hash_ids = self._hash_pooled(input_ids, batch)
        h, pre_mix = self.embed_streams(input_ids)
        rows, cur = None, batch                     # rows: the current rows' indices in the step (None: all)
        targets = set(self.cfg.dspark_target_layer_ids) if batch.draft_rings and hasattr(self, "mtp") else ()
        features = {}
        for i, block in enumerate(self.layers):
            if block.engram is not None:
                h = block.engram(h, (hash_ids if rows is None else hash_ids[rows])[:, block.engram.layer_index])
            if i in targets:
                features[i] = (rows, h.mean(dim=1))
            keep = self._truncated_counts(cur, i)
            if keep is None:
                h, pre_mix = block(h, pre_mix, lambda x, attn=block.attn: attn(x, cur, query_rows=rows))
                continue
            nxt, qrows = cur.keep_last(keep)
            out_rows = qrows if rows is None else rows[qrows]
            h, pre_mix = block(h, pre_mix, lambda x, attn=block.attn: attn(x, cur, qrows, out_rows), qrows)
            rows, cur = out_rows, nxt
        if targets:
            self._write_draft_rings(batch, features)
        hidden = self.norm(hc_collapse(h, pre_mix))
        if rows is None:
            return hidden
        return hidden.new_zeros(input_ids.shape[0], hidden.shape[-1]).index_copy_(0, rows, hidden)

    def _write_draft_rings(self, batch: ForwardBatch, features: dict) -> None:
        """DSpark observe over the pools: each segment's last window positions write kv(main_x) of their target
        features (the streams entering each target layer, averaged over hc) into every stage's ring."""
        wanted = batch.last_rows(self.cfg.sliding_window)                    # [M] step rows
        parts = []
        for layer in self.cfg.dspark_target_layer_ids:
            rows, feat = features[layer]                                     # feat [rows at that layer, D]
            if rows is not None:                                             # YOCO: fewer rows at that layer
                at = torch.full((batch.num_rows,), -1, dtype=torch.long, device=feat.device)
                at[rows] = torch.arange(rows.shape[0], device=feat.device)
                feat = feat[at[wanted]]
            else:
                feat = feat[wanted]
            parts.append(feat)
        main_x = self.dspark.main_x(torch.cat(parts, dim=-1))                 # [M, D]
        cos, sin = self.mtp[0].attn.rope(batch.positions[wanted])
        for i, stage in enumerate(self.mtp):
            batch.write_ring_rows(batch.pools.rings[f"mtp.{i}.window"], wanted, stage.attn.window_kv(main_x, cos, sin))

    # ---- DSpark drafting over the pools ----
    @property
    def draft_block_size(self) -> int | None:
        """Drafts one draft block proposes (None: no DSpark stages)."""
        return self.cfg.dspark_block_size if hasattr(self, "mtp") else None

    draft_method = "dspark"

    def draft(self, pools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, sample,
              steps: int) -> DraftOutput:
        """One draft block per row: sequence slot slots[r] [R] has its target state (and draft rings) up to position
        positions[r] = p; tokens [R] is the target's token for p+1. sample(i, logits [R, V]) draws draft i (for
        position p+2+i). The rings are the ones the runtime forward keeps (ForwardBatch.draft_rings). The block
        drafts all its positions in one pass; the first `steps` are returned."""
        rings = [pools.rings[f"mtp.{i}.window"] for i in range(len(self.mtp))]
        out = self.dspark.draft_pooled(self.embed, self.head, rings, self.cfg.sliding_window, slots, positions,
                                       tokens, sample)
        return DraftOutput(out.tokens[:, :steps], out.logits[:, :steps], out.confidence[:, :steps])

    def _truncated_counts(self, batch: ForwardBatch, layer: int) -> list[int] | None:
        """Query rows each segment keeps at `layer` under YOCO truncation (None: every row, nothing to cut):
        a last_only segment keeps the positions within (L-1-layer)(W-1) of its last one."""
        cfg = self.cfg
        if batch.last_only is None or layer < cfg.truncation_start or not any(batch.last_only):
            return None
        span = (cfg.num_hidden_layers - 1 - layer) * (cfg.sliding_window - 1)
        lens = batch.host[2]
        keep = [min(n, span + 1) if cut else n for n, cut in zip(lens, batch.last_only)]
        return None if keep == lens else keep

    def _hash_pooled(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Engram hash ids [N, L, C]: each row's compressed id and its look-back (newest first), from the
        look-back ring and this step's rows."""
        if not self.cfg.engram_layer_ids:
            return None
        hasher = self._bound_hasher()
        ring = batch.pools.rings["engram"]                                     # [S, n-1, 1]
        ids = hasher.compressed(input_ids).unsqueeze(1)                        # [N, 1]
        store = batch.store(ring, ids).squeeze(1)
        back = batch.pools.spans["engram"]                                     # n - 1 (the ring may hold more)
        at = batch.positions_index(None, back + 1, ring.shape[1])              # [N, n] oldest first
        window = torch.where(at >= 0, store[at.clamp(min=0)], BLOCKED).flip(1)
        batch.write_ring(ring, ids)
        return hasher.hash_window(window)

    def _bound_hasher(self) -> EngramHasher:
        if self.hasher is None:
            raise DeepInferError("this model has engram layers: bind its tokenizer first "
                                 "(model.bind_tokenizer(tokenizer)); load_model does it from the checkpoint")
        return self.hasher

    # ---- the reference forward (the oracle) ----
    def forward_reference(self, input_ids: torch.Tensor, chunks: list[tuple[int, int]], states: list[SequenceState],
                          last_only: bool = False, feature_window: int = 0) -> ForwardOutput:
        """input_ids [N]: new tokens of len(states) sequences, sequence i owning rows chunks[i].
        last_only: only each chunk's last row needs an output (YOCO truncation).
        feature_window > 0: also return DSpark features for each chunk's last `feature_window` rows."""
        cfg = self.cfg
        dev = self.device
        positions, seqs = self._claim_positions(chunks, states)
        hash_ids = self._hash(input_ids, chunks, states)
        h, pre_mix = self.embed_streams(input_ids)
        rows = torch.arange(input_ids.shape[0], device=dev)       # current rows -> input rows
        targets = list(cfg.dspark_target_layer_ids) if feature_window else []
        features = {}
        last_pos = [s.pos0 + s.end - s.start - 1 for s in seqs]
        for i, block in enumerate(self.layers):
            if block.engram is not None:
                h = block.engram(h, hash_ids[rows, block.engram.layer_index])
            if i in targets:
                features[i] = (rows, h.mean(dim=1))
            qrows = None
            if last_only and i >= cfg.truncation_start:
                span = (cfg.num_hidden_layers - 1 - i) * (cfg.sliding_window - 1)
                qrows = self._query_rows(seqs, [t - span for t in last_pos])
            h, pre_mix = block(h, pre_mix, lambda x: block.attn.forward_reference(x, positions, seqs), qrows)
            if qrows is not None:
                rows, positions = rows[qrows], positions[qrows]
                seqs = self._shrink(seqs)
        hidden = self.norm(hc_collapse(h, pre_mix))
        out = ForwardOutput(hidden, rows)
        if targets:
            out.features, out.feature_rows = self._features(features, chunks, feature_window, input_ids.shape[0])
        return out

    def embed_streams(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [N] -> (hc copies of the embedding [N, hc, D], the one-hot first pre-mix [N, hc])."""
        h = self.embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(h.shape[:2], dtype=torch.float32 if self.dtype != torch.float64 else self.dtype,
                              device=h.device)
        pre_mix[:, 0] = 1
        return h, pre_mix

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, D] final hidden -> [M, vocab] fp32 logits."""
        return self.head.fp32(hidden).float()

    # ---- row bookkeeping ----
    def _claim_positions(self, chunks, states) -> tuple[torch.Tensor, list[SeqRows]]:
        pos, seqs = [], []
        for (start, end), st in zip(chunks, states):
            first = st.num_tokens
            st.num_tokens = first + end - start
            pos.append(torch.arange(first, first + end - start))
            seqs.append(SeqRows(start, end, start, first, first, st))
        return torch.cat(pos).to(self.device), seqs

    def _query_rows(self, seqs: list[SeqRows], cut: list[int]) -> torch.Tensor:
        """Mark rows at or after each sequence's cut position as query rows; returns their indices."""
        keep = []
        for s, c in zip(seqs, cut):
            s.q_start = s.start + min(max(c - s.pos0, 0), s.end - s.start - 1)
            keep.append(torch.arange(s.q_start, s.end))
        return torch.cat(keep).to(self.device)

    @staticmethod
    def _shrink(seqs: list[SeqRows]) -> list[SeqRows]:
        """After a truncated layer the query rows become the next layer's input rows."""
        out, start = [], 0
        for s in seqs:
            n = s.end - s.q_start
            out.append(SeqRows(start, start + n, start, s.pos0 + s.q_start - s.start, s.prev_tokens, s.state,
                               s.shared))
            start += n
        return out

    def _features(self, features: dict, chunks, window: int, n_rows: int):
        """DSpark input: per chunk, its last `window` rows of the streams entering each target layer,
        averaged over the hc streams and concatenated -> ([F, n_targets*D], input row indices [F])."""
        want = torch.zeros(n_rows, dtype=torch.bool, device=self.device)
        for start, end in chunks:
            want[max(start, end - window):end] = True
        parts = []
        for layer in self.cfg.dspark_target_layer_ids:
            rows, feat = features[layer]
            parts.append(feat[want[rows]])
        return torch.cat(parts, dim=-1), want.nonzero().squeeze(1)

    def _hash(self, input_ids: torch.Tensor, chunks, states) -> torch.Tensor | None:
        if not self.cfg.engram_layer_ids:
            return None
        self._bound_hasher()
        before = [self.hasher.new_state(self.device) if st.engram is None else st.engram for st in states]
        ids, after = self.hasher.hash_ids_flat(input_ids, chunks, before)
        for st, new in zip(states, after):
            st.engram = new
        return ids

    # ---- conveniences on top ----
    @torch.inference_mode()
    def compute_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Stateless full forward: input_ids [B, T] -> logits [B, T, vocab] fp32."""
        ids, chunks = self.batch_chunks(input_ids)
        out = self.forward_reference(ids, chunks, [self.new_state() for _ in chunks])
        return self.logits(out.hidden).view(*input_ids.shape, -1)

    @staticmethod
    def _last_rows(rows: torch.Tensor, chunks) -> torch.Tensor:
        """Index of each chunk's last input row within `rows` (output or feature row indices)."""
        ends = torch.tensor([e - 1 for _, e in chunks], device=rows.device)
        return (rows.unsqueeze(0) == ends.unsqueeze(1)).float().argmax(dim=1)

    @torch.inference_mode()
    def extend_and_draft(self, token_chunks: list[torch.Tensor], states: list[SequenceState],
                         sample=greedy) -> tuple[torch.Tensor, torch.Tensor, DraftOutput]:
        """Append token_chunks[i] to sequence i (YOCO-truncated), sample the next token y_i from the
        last position p_i, fill the DSpark rings and draft a block after y_i.
        Returns (y [B], target logits at p [B, V], drafts for p+2 ..)."""
        if not hasattr(self, "mtp"):
            raise DeepInferError("this model has no DSpark draft stages (num_nextn_predict_layers = 0)")
        ids, chunks = self.flat_chunks(token_chunks, states)
        w = self.cfg.sliding_window
        for (s, e), st in zip(chunks, states):
            self.dspark.check_write(st, st.num_tokens + max(0, e - s - w), min(e - s, w))
        out = self.forward_reference(ids, chunks, states, last_only=True, feature_window=w)
        logits = self.logits(out.hidden[self._last_rows(out.rows, chunks)])
        tokens = sample(logits)
        # feature rows -> (owner sequence, absolute position)
        owner = torch.bucketize(out.feature_rows, torch.tensor([e for _, e in chunks], device=self.device), right=True)
        first_pos = torch.tensor([st.num_tokens - (e - s) - s for (s, e), st in zip(chunks, states)],
                                 device=self.device)
        positions = out.feature_rows + first_pos[owner]
        self.dspark.observe(out.features, positions, owner.tolist(), states)
        last = self._last_rows(out.feature_rows, chunks)
        drafts = self.dspark.draft(self.embed, self.head, out.features[last], positions[last], tokens, states, sample,
                                   write=False)
        return tokens, logits, drafts

    @torch.inference_mode()
    def extend(self, token_chunks: list[torch.Tensor], states: list[SequenceState],
               last_only: bool = False) -> list[torch.Tensor]:
        """Append token_chunks[i] ([T_i]) to sequence i; return each chunk's logits [T_i, V]
        (last_only: [1, V], computed with YOCO truncation)."""
        ids, chunks = self.flat_chunks(token_chunks, states)
        out = self.forward_reference(ids, chunks, states, last_only=last_only)
        logits = self.logits(out.hidden)
        if last_only:
            return [logits[i:i + 1] for i in self._last_rows(out.rows, chunks).tolist()]
        return [logits[s:e] for s, e in chunks]
