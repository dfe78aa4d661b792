"""DeepSeek-V4 (Flash) reference model, module and parameter names as in DeepSeek's checkpoint.

Top level: embed -> copy into hc_mult streams -> blocks -> hc_head -> norm -> head. A block is
  pre, post, comb = mixes(h);  h = hc_post(attn(attn_norm(collapse(h, pre))), h, post, comb)
  pre, post, comb = mixes(h);  h = hc_post(ffn(ffn_norm(collapse(h, pre))), h, post, comb)
`forward` takes a flat batch of new tokens [N] of any number of sequences (prefill chunks, decode and verify rows
alike) over the state pools (cache/forward_batch.py) and returns the final hidden [N, D]. The oracle tests compare
it with runs the same blocks over one state per sequence (engine/reference/v4.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ...cache.forward_batch import ForwardBatch
from ...cache.spec import StateSpec
from ...config.deepseek_v4 import MOE, SLIDING, DeepseekV4Config
from ..base import Drafting
from ..common.flat_batch import FlatBatchLM
from ..common.layers import Linear, RMSNorm, fp32_param
from ..common.mhc import HyperConnectionSites, hc_collapse, hc_head, hc_post
from ..common.moe import MoE
from ..common.rope import RotaryEmbedding
from . import mtp
from .attention import Attention


class Block(HyperConnectionSites):
    def __init__(self, cfg: DeepseekV4Config, layer_type: str, mlp_type: str, rope: RotaryEmbedding,
                 dtype: torch.dtype, qat_fake_quant: bool):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.attn_norm, self.ffn_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer_type, rope, dtype, qat_fake_quant)
        self.ffn = MoE.for_v4(cfg, mlp_type, dtype)
        self.init_sites(cfg)

    def _pre(self, h: torch.Tensor, site: str):
        """V4: a site collapses the streams with its own pre -> (block input, post, comb)."""
        pre, post, comb = self.mixes(h, site)
        return hc_collapse(h, pre), post, comb

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, attend) -> torch.Tensor:
        """The block around its attention: h [N, hc, D] -> [N, hc, D]; attend maps the normed attention
        input [N, D] to the attention output [N, D] (over the state pools, or the oracle's per-sequence states)."""
        x, post, comb = self._pre(h, "attn")
        h = hc_post(attend(self.attn_norm(x)), h, post, comb)
        x, post, comb = self._pre(h, "ffn")
        return hc_post(self.ffn(self.ffn_norm(x), input_ids), h, post, comb)


class HyperHead(nn.Module):
    """Owner of hc_head_{fn,base,scale} + norm (the model itself and each MTP layer): streams -> hidden."""

    def _init_head(self, cfg: DeepseekV4Config) -> None:
        self.hc_head_fn = fp32_param(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size)
        self.hc_head_base, self.hc_head_scale = fp32_param(cfg.hc_mult), fp32_param(1)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """[N, hc, D] -> [N, D]."""
        c = self.cfg
        return self.norm(hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale,
                                 c.hc_eps, c.rms_norm_eps))


class MTPLayer(Block, HyperHead):
    """NextN layer `mtp.{i}`: a sliding-window block fed (streams at t, token t+1); predicts t+2.
    Embedding and lm head are the main model's."""

    def __init__(self, cfg: DeepseekV4Config, rope: RotaryEmbedding, dtype: torch.dtype, qat_fake_quant: bool):
        Block.__init__(self, cfg, SLIDING, MOE, rope, dtype, qat_fake_quant)
        d = cfg.hidden_size
        self.enorm, self.hnorm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        self.e_proj, self.h_proj = Linear(d, d, dtype), Linear(d, d, dtype)
        self._init_head(cfg)

    def combine(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The embedding of token t+1 [N, D] and the target's streams at t [N, hc, D] -> block input [N, hc, D]."""
        return self.e_proj(self.enorm(embedded)).unsqueeze(1) + self.h_proj(self.hnorm(streams))

    def window_latent(self, h: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The latent the block's attention keeps for input streams h [N, hc, D] at the rows' positions -> [N, d]."""
        x, _, _ = self._pre(h, "attn")
        return self.attn.latent(self.attn_norm(x), rotary)


class DeepseekV4ForCausalLM(FlatBatchLM, HyperHead):
    def __init__(self, cfg: DeepseekV4Config, dtype: torch.dtype = torch.float32, qat_fake_quant: bool = True):
        super().__init__()
        self.init_common(cfg, dtype, qat_fake_quant)
        self.layers = nn.ModuleList(
            Block(cfg, t, m, self.rope_main if t == SLIDING else self.rope_compress, dtype, qat_fake_quant)
            for t, m in zip(cfg.layer_types, cfg.mlp_layer_types))
        self._init_head(cfg)
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.mtp = nn.ModuleList(MTPLayer(cfg, self.rope_main, dtype, qat_fake_quant)
                                 for _ in range(cfg.num_nextn_predict_layers))
        self.drafting = Drafting(cfg.DRAFT_METHOD, mtp.MAX_STEPS, mtp.RINGS, ("mtp",)) if len(self.mtp) else None

    def state_spec(self) -> StateSpec:
        """Every layer's per-sequence state, and the NextN drafter's (mtp.py) when the checkpoint has one."""
        kinds = [k for i, b in enumerate(self.layers) for k in b.attn.state_kinds(i)]
        depths, final = self.layer_depths()
        return StateSpec.of(kinds + (mtp.state_kinds(self) if self.drafting is not None else [])).with_depths(
            lambda name: mtp.ring_depth(name, final) if name.startswith("mtp.") else depths[int(name.split(".")[0])])

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """input_ids [Q]: the step's query rows (batch says whose and where; every row but under context parallelism,
        batch.query_rows) -> final hidden [Q, D]. The attention reads every row's input (batch.all_rows). The NextN
        drafter reads the last streams [N, hc, D] before they collapse (mtp.observe)."""
        h = self.embed_streams(input_ids)
        for i, block in enumerate(self.layers):
            h = block(h, input_ids, lambda x, attn=block.attn, i=i: attn(batch.all_rows(x), batch, i, batch.query_rows))
        if batch.draft_rings and self.drafting is not None:
            mtp.observe(self, h, input_ids, batch)
        return self.collapse(h)

    def draft(self, pools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, sample,
              steps: int) -> mtp.MTPDrafts:
        """`steps` drafts per row: slot slots[r] [R] holds the target up to position positions[r] = p, tokens [R]
        is the target's token for p+1; sample(i, logits [R, V]) draws draft i (position p+2+i)."""
        return mtp.draft(self, pools, slots, positions, tokens, sample, steps)

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> [N, hc, D]: the embedding copied into every residual stream."""
        return self.embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[M, D] final hidden -> [M, vocab] fp32 logits."""
        return self.head.fp32(hidden).float()
