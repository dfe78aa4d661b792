"""DSpark draft stages of DeepSeek-V4.1 (`mtp.0` .. `mtp.{n-1}`), after DeepSeek's inference code, over the state
pools (the per-sequence oracle of the same procedure is engine/reference/dspark.py).

Target features: the streams entering each target layer (after any engram), averaged over the hc
streams, concatenated: [S, n_targets*D]. `mtp.0` maps them to main_x = main_norm(main_proj(f)).
Each stage is a full block (single-pass mHC, sliding attention with the main rope, its own MoE)
whose window ring holds K=V latents of main_x (target-derived), one per target position.

Drafting after the target processed position p and sampled y for p+1:
  1. every stage writes kv(main_x_p) into its ring at p;
  2. the block [y, noise x (B-1)] is embedded into hc copies (one-hot pre-mix) and runs through
     the stages; its queries at p+1..p+B attend to the ring (positions <= p, at most one window)
     and to all B block entries, with no causal mask inside the block;
  3. after the last stage: logits = head(norm(collapse(h))); left to right, logits[i] gets the
     Markov bias head_m . embed_m[prev_i] (prev_0 = y, then the previous draft), the token is
     sampled, and confidence[i] = proj([x_i ; embed_m[prev_i]]) (x_i before the norm, a raw logit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from deepinfer.kernels.attention import SplitStore, sparse_sink_attention
from deepinfer.kernels.matmul import linear, linear_f32
from deepinfer.kernels.precision import upcast

from ...config.deepseek_v41 import DeepseekV41Config
from ...errors import DeepInferError
from ..common.layers import Linear, RMSNorm
from ..common.mhc import hc_collapse
from ..common.rope import RotaryEmbedding
from .block import BlockV41


@dataclass
class DraftOutput:
    tokens: torch.Tensor       # [B, block] drafts for positions p+2 .. p+block+1
    logits: torch.Tensor       # [B, block, V] fp32, Markov bias included (the draft distributions)
    confidence: torch.Tensor   # [B, block] fp32 raw confidence logits

    def probs(self, temperature: float = 1.0) -> torch.Tensor:
        """[B, block, V] draft distributions at `temperature` (> 0)."""
        if temperature <= 0:
            raise DeepInferError(f"temperature must be > 0 for a distribution, got {temperature}")
        return torch.softmax(self.logits / temperature, dim=-1)

    def acceptance_confidence(self) -> torch.Tensor:
        """[B, block] sigmoid of the confidence logits."""
        return torch.sigmoid(self.confidence)


class MarkovHead(nn.Module):
    """Low-rank previous-token bias: bias(prev) = head . embed[prev] in fp32."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.head = Linear(rank, vocab, dtype)

    def forward(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev [B] -> (bias [B, V] fp32, embedding [B, rank])."""
        e = self.embed(prev)
        return linear_f32(e, self.head.weight), e


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.proj = Linear(dim, 1, dtype)

    def forward(self, x: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """x [B, D], markov_embed [B, r] -> [B] fp32 raw logits."""
        both = torch.cat([upcast(x), upcast(markov_embed)], dim=-1)
        return linear(both, upcast(self.proj.weight)).squeeze(-1)


def _stage_block(cfg: DeepseekV41Config, stage: int, rope: RotaryEmbedding, dtype, qat: bool, expert_storage: str):
    return BlockV41(cfg, cfg.num_hidden_layers + stage, rope, rope, dtype, qat, cfg.dspark_n_routed_experts,
                    cfg.dspark_num_experts_per_tok, expert_storage)


def build_stages(cfg: DeepseekV41Config, rope_main: RotaryEmbedding, dtype: torch.dtype, qat: bool,
                 expert_storage: str = "dense") -> nn.ModuleList:
    """The checkpoint's `mtp.{i}` modules: backbone blocks, plus main_proj/main_norm on the first and
    norm, markov_head, confidence_head on the last (none without num_nextn_predict_layers)."""
    stages = nn.ModuleList(_stage_block(cfg, i, rope_main, dtype, qat, expert_storage)
                           for i in range(cfg.num_nextn_predict_layers))
    if not len(stages):
        return stages
    first, last = stages[0], stages[-1]
    first.main_proj = Linear(len(cfg.dspark_target_layer_ids) * cfg.hidden_size, cfg.hidden_size, dtype)
    first.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    last.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    last.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank, dtype)
    last.confidence_head = ConfidenceHead(cfg.hidden_size + cfg.dspark_markov_rank, dtype)
    return stages


class DSpark:
    """The draft procedure over the stages (which the model owns as `mtp`, so they load by name)."""

    def __init__(self, cfg: DeepseekV41Config, stages: nn.ModuleList):
        self.cfg, self.stages, self.window = cfg, stages, cfg.sliding_window

    def main_x(self, features: torch.Tensor) -> torch.Tensor:
        """[S, n_targets*D] target features -> [S, D]."""
        return self.stages[0].main_norm(self.stages[0].main_proj(features))

    def draft(self, embed: nn.Embedding, head: Linear, rings: list[torch.Tensor], window: int,
                     slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                     sample: Callable[[int, torch.Tensor], torch.Tensor]) -> DraftOutput:
        """One draft block per row r of sequence slot slots[r] [R], whose rings
        (rings[i]: stage i's pool [S, span', d], position t at row t % span') hold the target's positions up to
        positions[r] (= p); tokens [R] the target's sample for p+1. sample(i, logits [R, V] fp32) -> the drafts
        [R] for positions p+2+i. Static shapes throughout (a CUDA graph can hold it)."""
        bsz, blk = tokens.shape[0], self.cfg.dspark_block_size
        h, pre, qpos = self.block_inputs(embed, tokens, positions)
        span = rings[0].shape[1]
        tp = positions.unsqueeze(1) - (window - 1) + torch.arange(window, device=positions.device)   # [R, W]
        ring_idx = torch.where(tp >= 0, slots.unsqueeze(1) * span + tp % span, -1)
        block_idx = torch.arange(bsz * blk, device=positions.device).view(bsz, blk)                  # [R, blk]
        for i, stage in enumerate(self.stages):
            flat = rings[i].flatten(0, 1)
            index = torch.cat([ring_idx, flat.shape[0] + block_idx], dim=1).repeat_interleave(blk, dim=0)
            h, pre = stage(h, pre, lambda x, attn=stage.attn, flat=flat, index=index:
                           self._attend(attn, x, qpos, flat, index))
        return self.head_drafts(head, h, pre, tokens, bsz, blk, sample)

    def block_inputs(self, embed: nn.Embedding, tokens: torch.Tensor, positions: torch.Tensor):
        """The draft block's inputs for rows anchored at positions p [B] with the target's token for p+1 [B]:
        (streams [B*blk, hc, D] of that token then noise tokens, the stream pre-weights [B*blk, hc] (all on
        stream 0), the block rows' positions p+1 .. p+blk [B*blk])."""
        cfg = self.cfg
        bsz, blk = tokens.shape[0], cfg.dspark_block_size
        ids = torch.full((bsz, blk), cfg.dspark_noise_token_id, dtype=torch.long, device=tokens.device)
        ids[:, 0] = tokens
        h = embed(ids.view(-1)).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = torch.zeros(h.shape[:2], dtype=upcast(h).dtype, device=h.device)
        pre[:, 0] = 1
        qpos = (positions.unsqueeze(1) + 1 + torch.arange(blk, device=positions.device)).reshape(-1)
        return h, pre, qpos

    def head_drafts(self, head: Linear, h: torch.Tensor, pre: torch.Tensor, tokens: torch.Tensor, bsz: int,
                    blk: int, sample: Callable[[int, torch.Tensor], torch.Tensor]) -> DraftOutput:
        """The last stage's streams -> logits with the Markov bias, drafts left to right, confidences."""
        last = self.stages[-1]
        x = hc_collapse(h, pre)                                                        # [B*blk, D]
        logits = head.fp32(last.norm(x)).float().view(bsz, blk, -1)
        x = x.view(bsz, blk, -1)
        drafts, conf, prev = [], [], tokens
        for i in range(blk):
            bias, m_embed = last.markov_head(prev)
            logits[:, i] += bias.to(logits.dtype)
            conf.append(last.confidence_head(x[:, i], m_embed).float())
            prev = sample(i, logits[:, i])
            drafts.append(prev)
        return DraftOutput(torch.stack(drafts, 1), logits, torch.stack(conf, 1))

    @staticmethod
    def _attend(attn, x: torch.Tensor, qpos: torch.Tensor, flat: torch.Tensor, index: torch.Tensor
                       ) -> torch.Tensor:
        """x [R*blk, D]: each block row attends to its sequence's ring window (read in place) and its whole block."""
        cos, sin = attn.rope(qpos)
        q, _ = attn.queries(x, cos, sin)                                              # [R*blk, H, d]
        kv = attn.window_kv(x, cos, sin)                                              # [R*blk, d]
        out = sparse_sink_attention(q, [(SplitStore(flat, kv.to(flat.dtype)), index)], attn.attn_sink,
                                    attn.head_dim ** -0.5)
        return attn.output(out, cos, sin)
