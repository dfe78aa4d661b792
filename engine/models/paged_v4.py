"""DeepSeek-V4 decode over the preallocated state pools (engine/cache/pools.py): one new token per row, batched,
every shape fixed by the batch size B, `ctx_blocks` and the pool shapes, no host synchronisation; so one CUDA
graph per (B, ctx_blocks) can capture it.

The math is the reference path's (attention.py, compressor.py, whose per-token pieces it calls); only where the
state lives differs. Row b (slot s, position p), per layer:
  window ring  pools.window[l][s, p % W]           <- this token's K=V latent; attention reads the W rows in
                                                      position order p-W+1 .. p (those < 0 hidden)
  pending      pools.pending_*[stream][s, p % r]   <- this token's compressor kv and score
  prev A       pools.prev_a_*[stream][s]           <- the A halves of a window that closes now
  entries      pools.entries[stream][blk, row]     <- entry p // r when (p+1) % r == 0; scratch block 0 otherwise
Every row pools its window as if it closed (static shapes) and writes the result to scratch when it did not.
Slot 0 is a padding row: its block-table row is all scratch, so everything it writes lands in scratch.
Unwritten pool memory is never read: hidden keys are zeroed before attention, hidden index scores are -inf.
MTP layers are not part of this step.

The caller's part: a real slot appears at most once per batch, and the block holding position p is in the
slot's block-table row before the step (an entry whose block is still 0 lands on scratch and is lost).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from deepinfer.kernels.attention import sink_attention_rows
from deepinfer.kernels.precision import upcast

from ..cache.pools import SCRATCH, StatePools, ring_window
from .attention import Attention, visibility_bias
from .compressor import Compressor, no_predecessor
from .moe import all_experts_routing
from .selection import visible_entries


@dataclass
class Rows:
    """The batch's rows: B = len(slots)."""
    slots: torch.Tensor       # [B] int64 pool slot (0 = padding)
    positions: torch.Tensor   # [B] int64 absolute position of the new token
    block: torch.Tensor       # [B] int64 pool block holding position p (so entry p // r of every stream)
    blocks: torch.Tensor      # [B, C] int64 pool blocks of block-table columns 0 .. ctx_blocks-1

    @classmethod
    def of(cls, pools: StatePools, slots: torch.Tensor, positions: torch.Tensor, ctx_blocks: int) -> "Rows":
        table = pools.block_table[slots].long()                                       # [B, max_blocks]
        col = (positions // pools.layout.block_tokens).clamp(max=pools.max_blocks - 1)
        return cls(slots, positions, table.gather(1, col.unsqueeze(1)).squeeze(1), table[:, :ctx_blocks])


@torch.inference_mode()
def decode_step(model, pools: StatePools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                ctx_blocks: int) -> torch.Tensor:
    """slots, positions, tokens: [B] int64 on the model device (slot 0 = padding row); positions = the
    absolute position of each row's token (= tokens already in its state). ctx_blocks: how many block-table
    columns to read (static; covers every row's entries). Returns logits [B, vocab] fp32 (as model.logits)."""
    rows = Rows.of(pools, slots, positions, ctx_blocks)
    h = model.embed_streams(tokens)                                                   # [B, hc, D]
    with all_experts_routing():
        for layer, block in enumerate(model.layers):
            attend = functools.partial(_attention, block.attn, pools=pools, rows=rows, layer=layer)
            h = block.forward_with(h, tokens, attend)                                 # [B, hc, D]
    return model.logits(h)


def _attention(attn: Attention, x: torch.Tensor, pools: StatePools, rows: Rows, layer: int) -> torch.Tensor:
    """x [B, D] normed attention input -> [B, D]; updates the layer's pool state."""
    q, kv, comp, idx, (cos, sin) = attn.project(x, rows.positions)                    # q [B, H, d], kv [B, d]
    keys, visible = ring_window(pools.window[layer], rows.slots, rows.positions, kv)                            # [B, W, d], [B, W]
    if attn.compressor is not None:
        entries = _compress(attn, attn.compressor, *comp, pools, f"{layer}.kv", rows,
                            attn._quantize_entry)                                     # [B, n, d]
        if attn.indexer is not None:
            index_kv, index_gate, index_q, index_w = idx
            index_keys = _compress(attn, attn.indexer.compressor, index_kv, index_gate, pools, f"{layer}.index",
                                   rows, attn._quantize_index)                        # [B, n, dI]
            shown = attn.indexer.select(index_q, index_w, index_keys, rows.positions)  # [B, n] top-k
        else:
            shown = visible_entries(rows.positions, entries.shape[1], attn.ratio)     # [B, n]
        keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)                       # [B, W + n, d]
        visible = torch.cat([visible, shown], dim=1)
    keys = torch.where(visible.unsqueeze(-1), keys, 0)   # hidden rows may hold anything (stale, scratch)
    out = sink_attention_rows(q, keys, visibility_bias(visible), attn.attn_sink, attn.head_dim ** -0.5)
    return attn.output(out, cos, sin)                                                 # [B, D]


def _compress(attn: Attention, comp: Compressor, kv: torch.Tensor, gate: torch.Tensor, pools: StatePools,
              name: str, rows: Rows, quantize) -> torch.Tensor:
    """One entry stream. kv, gate [B, c*d] (Compressor.project) go to pending row p % r; every row pools its
    window (Compressor.entries) and writes it as entry p // r if the window closes now, to scratch otherwise.
    Returns the stream's entries [B, C*E, dim] of block-table columns 0 .. C-1 (E entries per block)."""
    r, s, p = comp.ratio, rows.slots, rows.positions
    pend_kv, pend_score = pools.pending_kv[name], pools.pending_score[name]          # [S, r, c*d]
    pend_kv[s, p % r] = upcast(kv).to(pend_kv.dtype)
    pend_score[s, p % r] = comp.scores(gate, p).to(pend_score.dtype)
    win_kv, win_score = pend_kv[s], pend_score[s]                                     # [B, r, c*d]
    closing = (p + 1) % r == 0                                                        # [B]
    prev_a = _predecessors(comp, pools, name, rows, closing, win_kv, win_score) if comp.overlap else None
    new = attn.final_entries(comp.entries(win_kv, win_score, prev_a, p // r, attn.rope), quantize)   # [B, dim]
    store = pools.entries[name]                                                       # [NB, E, dim]
    per_block = store.shape[1]
    store[torch.where(closing, rows.block, SCRATCH), (p // r) % per_block] = new.to(store.dtype)
    return store[rows.blocks].flatten(1, 2)                                           # [B, C*E, dim]


def _predecessors(comp: Compressor, pools: StatePools, name: str, rows: Rows, closing: torch.Tensor,
                  win_kv: torch.Tensor, win_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlapping stream: the A halves (kv, score) [B, r, d] each row's window pools from its predecessor
    (no_predecessor in window 0); then closing rows keep their own window's A halves for the next one."""
    d, s = comp.head_dim, rows.slots
    a_kv, a_score = pools.prev_a_kv[name], pools.prev_a_score[name]                   # [S, r, d]
    old_kv, old_score = a_kv[s], a_score[s]                                           # [B, r, d] (copies)
    none_kv, none_score = no_predecessor(old_kv, old_score)
    first = (rows.positions < comp.ratio).view(-1, 1, 1)
    prev = torch.where(first, none_kv, old_kv), torch.where(first, none_score, old_score)
    keep = closing.view(-1, 1, 1)
    a_kv[s] = torch.where(keep, win_kv[..., :d], old_kv)
    a_score[s] = torch.where(keep, win_score[..., :d], old_score)
    return prev
