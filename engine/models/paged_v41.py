"""Batched, fixed-shape decode step of DeepSeek-V4.1 over the preallocated state pools (cache/pools.py).

One new token per row, any mix of sequences and positions, padding rows on scratch slot 0. Shapes depend only
on the batch size B, `ctx_blocks` and the pool shapes, and nothing reads a tensor value on the host, so one
call can be captured in a CUDA graph and replayed with new slots / positions / tokens written into the same
input tensors. A write that must go nowhere (a row whose compressor window did not close, a padding row)
lands on scratch slot 0 / block 0 instead of being skipped.

Per layer it is the reference path's semantics for one token per sequence (AttentionV41._attend_one,
_publish and _select; the per-token math is the reference's own functions):
  window   the latent goes to ring row pos % W; keys = the ring gathered oldest first [B, W, d], visible where
           the key position pos-W+1 .. pos is >= 0;
  source   ratio r > 1: kv/gate to pending row pos % r, the group pools when (pos+1) % r == 0; ratio 1: every
           token is a group. Entry j = pos // r (rope at j*r, QAT) and its index key are written at
           block_table[slot, j // per_block], row j % per_block (scratch block 0 when the group is still open);
           the group's entries and keys are then gathered [B, ctx_blocks * per_block, dim] (entry j at j);
  select   index sources score the group's keys (-inf where j >= (pos+1)//r), the candidate source also keeps
           its candidate blocks and later index sources select inside them; other layers of the group use
           the latest selection.
The MoE runs every expert on every row (moe.all_experts_routing): no routing-dependent shapes.

The caller's part: every block a row writes into is in its block-table row before the step (an entry whose
block is still 0 lands on scratch and is lost; nothing can check that without a host sync), and a fresh
slot's engram look-back holds engram.BLOCKED (the pools start at 0), as a prefill through store_state leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels.attention import sink_attention_rows

from ..cache.pools import SCRATCH, StatePools, ring_window
from ..cache.sequence_state import CompressorState
from ..errors import DeepInferError
from .attention_v41 import AttentionV41, visibility_bias
from .mhc import hc_collapse
from .moe import all_experts_routing


@dataclass
class _Step:
    """One decode step's rows: slots [B], pos [B] (int64, on the model device); `shared` holds the current
    source group's products (as SeqRows.shared does for one sequence): entries [B, N, d], keys [B, N, dI],
    selected [B, N] bool, candidates [B, N] bool."""
    pools: StatePools
    slots: torch.Tensor
    pos: torch.Tensor
    ctx_blocks: int
    shared: dict = field(default_factory=dict)


@torch.inference_mode()
def decode_step(model, pools: StatePools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                ctx_blocks: int) -> torch.Tensor:
    """slots, positions, tokens: [B] int64 on the model device (slot 0 = padding row); positions = the
    absolute position of each row's token (= tokens already in its state). ctx_blocks: how many block-table
    columns to read (static; covers every row's entries). Returns logits [B, vocab] fp32 (as model.logits)."""
    step = _Step(pools, slots, positions, ctx_blocks)
    hash_ids = _engram_hash(model, step, tokens)                           # [B, L_engram, C] or None
    h, pre_mix = model.embed_streams(tokens)                               # [B, hc, D], [B, hc]
    with all_experts_routing():
        for block in model.layers:
            if block.engram is not None:
                h = block.engram(h, hash_ids[:, block.engram.layer_index])
            h, pre_mix = block(h, pre_mix, lambda x, attn=block.attn: _attend(attn, x, step))
    return model.logits(model.norm(hc_collapse(h, pre_mix)))


def _engram_hash(model, step: _Step, tokens: torch.Tensor) -> torch.Tensor | None:
    """Hash ids of every engram layer from the look-back pool [S, n-1], which moves on by the new tokens."""
    if not model.cfg.engram_layer_ids:
        return None
    if model.hasher is None:
        raise DeepInferError("this model has engram layers: bind its tokenizer first (model.bind_tokenizer)")
    ids, after = model.hasher.hash_next(tokens, step.pools.engram[step.slots])   # [B, L, C], [B, n-1]
    step.pools.engram[step.slots] = after
    return ids


def _attend(attn: AttentionV41, x: torch.Tensor, step: _Step) -> torch.Tensor:
    """x [B, D] (normed) -> [B, D]: AttentionV41._attend_one for one token per row."""
    cos, sin = attn.rope(step.pos)
    q, qr = attn.queries(x, cos, sin)                                      # [B, H, d], [B, q_lora]
    keys, visible = ring_window(step.pools.window[attn.layer], step.slots, step.pos, attn.window_kv(x, cos, sin))  # [B, W, d], [B, W]
    if attn.ratio:
        sh = step.shared
        if attn.compressor is not None:
            _publish(attn, x, step)
        if attn.indexer is not None and sh.get("keys") is not None:
            _select(attn, attn.indexer.queries(qr, x, cos, sin, attn.qat_fake_quant), step)
        entries = sh.get("entries")                                        # [B, N, d]
        if entries is not None:
            chosen = sh.get("selected")
            if chosen is None:
                chosen = torch.zeros(entries.shape[:2], dtype=torch.bool, device=x.device)
            keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)         # [B, W + N, d]
            visible = torch.cat([visible, chosen], dim=1)
    out = sink_attention_rows(q, keys, visibility_bias(visible), attn.attn_sink, attn.head_dim ** -0.5)
    return attn.output(out, cos, sin)


def _publish(attn: AttentionV41, x: torch.Tensor, step: _Step) -> None:
    """KV source: close the rows' groups, write entry j = pos // r and its index key (scratch block 0 where the
    group is still open), then the group's gathered products replace the previous group's."""
    pools, r, layer = step.pools, attn.ratio, attn.layer
    j = step.pos // r                                                       # [B]
    entries, keys = attn.compress(_latents(attn, x, step), j)             # [B, d], [B, dI] or None
    per_block = pools.layout.block_tokens // r
    col = (j // per_block).clamp(max=pools.max_blocks - 1)
    block = pools.block_table[step.slots, col].long()
    block = torch.where((step.pos + 1) % r == 0, block, SCRATCH)           # [B]
    names = [f"{layer}.kv"] + ([] if keys is None else [f"{layer}.index"])
    for name, new in zip(names, (entries, keys)):
        pool = pools.entries[name]                                          # [NB, per_block, dim]
        pool[block, j % per_block] = new.to(pool.dtype)
    sh = step.shared
    sh.clear()
    sh["entries"] = _gather(pools.entries[names[0]], step)                 # [B, N, d]
    sh["keys"] = None if keys is None else _gather(pools.entries[names[1]], step)   # [B, N, dI]


def _latents(attn: AttentionV41, x: torch.Tensor, step: _Step) -> torch.Tensor:
    """x [B, D] -> the pre-RoPE latent [B, d] of each row's group (meaningful where the group closes)."""
    comp = attn.compressor
    if comp.wgate is None:                                                  # ratio 1: every token is a group
        return comp.latents(x, CompressorState())
    name = f"{attn.layer}.kv"
    pend_kv, pend_score = step.pools.pending_kv[name], step.pools.pending_score[name]   # [S, r, d]
    kv, gate = comp.project(x)                                              # [B, d] each, >= fp32
    row = step.pos % comp.ratio
    pend_kv[step.slots, row] = kv.to(pend_kv.dtype)
    pend_score[step.slots, row] = gate.to(pend_score.dtype)
    return comp.pool(pend_kv[step.slots], pend_score[step.slots], x.dtype)   # rows 0..r-1 = positions j*r + 0..r-1


def _gather(pool: torch.Tensor, step: _Step) -> torch.Tensor:
    """Entries [NB, per_block, dim] of the rows' first ctx_blocks blocks -> [B, ctx_blocks * per_block, dim]."""
    blocks = step.pools.block_table[step.slots, :step.ctx_blocks].long()   # [B, C]
    return pool[blocks].flatten(1, 2)


def _select(attn: AttentionV41, index_q: tuple[torch.Tensor, torch.Tensor], step: _Step) -> None:
    """Index source: index_q = (q [B, H_I, dI], w [B, H_I]) scores the group's keys; keep the top-k (inside the
    candidates where they apply); the candidate source also publishes its candidate blocks."""
    sh, pos = step.shared, step.pos
    q, w = index_q
    scores = attn.indexer.scores(q.unsqueeze(1), w.unsqueeze(1), sh["keys"], pos.unsqueeze(1), attn.ratio)[:, 0]
    keep, candidates = attn.pick(scores, pos, attn.inside(sh, pos.shape[0]))  # [B, N] each
    if candidates is not None:
        sh["candidates"] = candidates
    sh["selected"] = keep
