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
state as a full prefill would (docs/model-v41.md). Compact truncation (ForwardBatch.keep_tokens, DeepInfer's
compact mode: docs/prefix-cache.md) keeps a constant last KEEP rows instead: approximate, since the
first kept rows of each later layer attend to window positions that layer never computed.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.gather import gather_rows

from ...cache.forward_batch import ForwardBatch
from ...cache.spec import Ring, StateSpec
from ...config.deepseek_v41 import DeepseekV41Config
from ...errors import DeepInferError
from ..base import Drafting
from ..common.flat_batch import FlatBatchLM
from ..common.layers import Linear, RMSNorm
from ..common.mhc import hc_collapse
from ..common.pooled import window_source
from .block import BlockV41
from .dspark import DSpark, DraftOutput, build_stages
from .engram import BLOCKED, EngramHasher


class DeepseekV41ForCausalLM(FlatBatchLM):
    truncates_prefill = True     # last_only pieces run YOCO-truncated: rows before a piece's end skip the top layers

    def __init__(self, cfg: DeepseekV41Config, dtype: torch.dtype = torch.float32, qat_fake_quant: bool = True,
                 expert_storage: str = "dense"):
        """expert_storage="fp4": routed experts stay FP4-packed and dequantize per use (common/moe.Experts)."""
        super().__init__()
        self.init_common(cfg, dtype, qat_fake_quant)
        self.layers = nn.ModuleList(
            BlockV41(cfg, i, self.rope_compress if cfg.compress_ratios[i] else self.rope_main, self.rope_compress,
                     dtype, qat_fake_quant, cfg.n_routed_experts, cfg.num_experts_per_tok, expert_storage)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.hasher: EngramHasher | None = None   # bound from the tokenizer (bind_tokenizer)
        self.mtp = build_stages(cfg, self.rope_main, dtype, qat_fake_quant, expert_storage)   # DSpark stages
        self.dspark = DSpark(cfg, self.mtp) if len(self.mtp) else None
        rings = tuple(f"mtp.{i}.window" for i in range(len(self.mtp)))
        self.drafting = Drafting(cfg.DRAFT_METHOD, cfg.dspark_block_size, rings, ("mtp",)) if len(self.mtp) else None

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
        if self.drafting is not None:
            kinds += [Ring(name, self.cfg.sliding_window, self.cfg.head_dim) for name in self.drafting.rings]
        depths, _ = self.layer_depths(self.cfg.engram_layer_ids, self.cfg.engram_max_ngram_size - 1)
        drafts = max((depths[t] for t in self.cfg.dspark_target_layer_ids), default=0)   # the stages' features

        def depth(name: str) -> int:
            if name == "engram":
                return 0                        # token ids: every replayed position writes its own
            return drafts if name.startswith("mtp.") else depths[int(name.split(".")[0])]
        return StateSpec.of(kinds).with_depths(depth)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [Q]: the step's query rows (batch says whose and where; every row but under context parallelism,
        batch.query_rows) -> final hidden [Q, D]. The attention and the engram hash read every row's input
        (batch.all_rows). Segments marked last_only run YOCO-truncated (module docstring): their rows before the
        last one come back as zeros."""
        hash_ids = self._hash_pooled(batch.all_rows(input_ids), batch)
        h, pre_mix = self.embed_streams(input_ids)
        rows, cur = batch.query_rows, batch         # rows: the current rows' indices in the step (None: all)
        cut = False                                 # YOCO truncated some rows
        targets = set(self.cfg.dspark_target_layer_ids) if batch.draft_rings and self.drafting is not None else ()
        features = {}
        for i, block in enumerate(self.layers):
            if block.engram is not None:
                h = block.engram(h, (hash_ids if rows is None else hash_ids[rows])[:, block.engram.layer_index])
            if i in targets:
                features[i] = (rows, h.mean(dim=1))
            keep = self._truncated_counts(cur, i)
            if keep is None:
                h, pre_mix = block(h, pre_mix, lambda x, attn=block.attn: attn(cur.all_rows(x), cur, cur.query_rows,
                                                                               rows))
                continue
            nxt, qrows = cur.keep_last(keep)
            out_rows = qrows if rows is None else rows[qrows]
            h, pre_mix = block(h, pre_mix, lambda x, attn=block.attn: attn(x, cur, qrows, out_rows), qrows)
            rows, cur, cut = out_rows, nxt, True
        if targets:
            self._write_draft_rings(batch, features)
        hidden = self.norm(hc_collapse(h, pre_mix))
        if not cut:
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
            batch.write_ring_rows(batch.pools.rings[self.drafting.rings[i]], wanted,
                                  stage.attn.window_kv(main_x, cos, sin))

    def draft(self, pools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, sample,
              steps: int) -> DraftOutput:
        """One draft block per row: sequence slot slots[r] [R] has its target state (and draft rings) up to position
        positions[r] = p; tokens [R] is the target's token for p+1. sample(i, logits [R, V]) draws draft i (for
        position p+2+i). The rings are the ones the runtime forward keeps (ForwardBatch.draft_rings). The block
        drafts all its positions in one pass; the first `steps` are returned."""
        rings = [pools.rings[name] for name in self.drafting.rings]
        out = self.dspark.draft(self.embed, self.head, rings, self.cfg.sliding_window, slots, positions,
                                       tokens, sample)
        return DraftOutput(out.tokens[:, :steps], out.logits[:, :steps], out.confidence[:, :steps])

    def _truncated_counts(self, batch: ForwardBatch, layer: int) -> list[int] | None:
        """Query rows each segment keeps at `layer` under YOCO truncation (None: every row, nothing to cut):
        a last_only segment keeps the positions within (L-1-layer)(W-1) of its last one (exact), or its last
        batch.keep_tokens (compact: DeepInfer's approximation, docs/prefix-cache.md)."""
        cfg = self.cfg
        if batch.last_only is None or layer < cfg.truncation_start or not any(batch.last_only):
            return None
        span = (cfg.num_hidden_layers - 1 - layer) * (cfg.sliding_window - 1) if batch.keep_tokens is None \
            else batch.keep_tokens - 1
        lens = batch.host[2]
        keep = [min(n, span + 1) if cut else n for n, cut in zip(lens, batch.last_only)]
        return None if keep == lens else keep

    def _hash_pooled(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | None:
        """Engram hash ids [N, L, C]: each row's compressed id and its look-back (newest first), from the
        look-back ring and this step's rows."""
        if not self.cfg.engram_layer_ids:
            return None
        hasher = self.bound_hasher()
        ring = batch.pools.rings["engram"]                                     # [S, n-1, 1]
        ids = hasher.compressed(input_ids).unsqueeze(1)                        # [N, 1]
        back = batch.pools.spans["engram"]                                     # n - 1 (the ring may hold more)
        window = gather_rows(*window_source(batch, ring, ids, back + 1), BLOCKED).squeeze(-1).flip(1)   # [N, n]
        batch.write_ring(ring, ids)                                            # after the read
        return hasher.hash_window(window)

    def bound_hasher(self) -> EngramHasher:
        if self.hasher is None:
            raise DeepInferError("this model has engram layers: bind its tokenizer first "
                                 "(model.bind_tokenizer(tokenizer)); load_model does it from the checkpoint")
        return self.hasher

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
