"""A DeepSeek-V4.1 block: [engram ->] attention -> MoE, around single-pass mHC (model.py's docstring has the
equations). The DSpark draft stages are blocks too (dspark.py)."""

from __future__ import annotations

import torch

from ...config.deepseek_v41 import DeepseekV41Config
from ..common.layers import RMSNorm
from ..common.mhc import HyperConnectionSites, hc_collapse, hc_post
from ..common.moe import Gate, MoE
from ..common.rope import RotaryEmbedding
from .attention import AttentionV41
from .engram import Engram


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
