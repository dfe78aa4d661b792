"""The V4 oracle: the model's blocks over one SequenceState per sequence, tensors growing by concatenation.

The runtime forward (models/deepseek_v4) runs the same blocks over the state pools; tests compare the two. A
compressor here feeds one sequence's new tokens through its open window (CompressorState.pending_*), and the
indexer scores every visible entry of that sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels.attention import sink_attention
from deepinfer.kernels.indexer import index_scores
from deepinfer.kernels.precision import upcast

from ..models.common.selection import top_k_mask
from .common import visibility_bias, visible_entries, window_keys
from .state import CompressorState, LayerState, SequenceState


@dataclass
class SeqSlice:
    """Rows [start, end) of the flat token batch belong to one sequence whose state is `state`."""
    start: int
    end: int
    layers: list[LayerState]
    first_pos: int


def new_state(model) -> SequenceState:
    return SequenceState(layers=[_layer_state(b.attn) for b in model.layers],
                         mtp=[_layer_state(m.attn) for m in model.mtp])


def _layer_state(attn) -> LayerState:
    return LayerState(compressor=None if attn.compressor is None else CompressorState(),
                      indexer=None if attn.indexer is None else CompressorState())


def forward_reference(model, input_ids: torch.Tensor, chunks: list[tuple[int, int]],
                      states: list[SequenceState]) -> torch.Tensor:
    """input_ids: [N] new tokens of len(states) sequences, sequence i owning rows chunks[i] = (start, end).
    Advances each state; returns the last streams [N, hc, D] (before hc_head)."""
    positions, seqs = _claim_positions(model, chunks, states, "layers", "num_tokens")
    h = model.embed_streams(input_ids)
    for i, block in enumerate(model.layers):
        h = block(h, input_ids, lambda x, attn=block.attn, i=i: attend(attn, x, positions, seqs, i))
    return h


def logits(model, streams: torch.Tensor) -> torch.Tensor:
    """[N, hc, D] streams -> [N, vocab] fp32 logits."""
    return model.logits(model.collapse(streams))


def all_logits(model, input_ids: torch.Tensor, chunks: list[tuple[int, int]],
               states: list[SequenceState]) -> torch.Tensor:
    """forward_reference, then every row's logits [N, vocab]."""
    return logits(model, forward_reference(model, input_ids, chunks, states))


def mtp_forward(model, streams: torch.Tensor, next_ids: torch.Tensor, chunks: list[tuple[int, int]],
                states: list[SequenceState], depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft step of mtp.{depth}: streams at positions t (rows as in forward_reference) and the tokens at t+1.
    Returns (logits [N, vocab] for t+2, the layer's output streams)."""
    layer = model.mtp[depth]
    positions, seqs = _claim_positions(model, chunks, states, "mtp", "num_mtp_tokens")
    h = layer(layer.combine(model.embed(next_ids), streams), next_ids,
              lambda x: attend(layer.attn, x, positions, seqs, depth))
    return model.head.fp32(layer.collapse(h)).float(), h


def _claim_positions(model, chunks, states, layer_attr: str, count_attr: str):
    """Positions [N] of the new rows, one SeqSlice per sequence; advances each state's token count."""
    pos, seqs = [], []
    for (start, end), st in zip(chunks, states):
        first = getattr(st, count_attr)
        setattr(st, count_attr, first + end - start)
        pos.append(torch.arange(first, first + end - start))
        seqs.append(SeqSlice(start, end, getattr(st, layer_attr), first))
    return torch.cat(pos).to(model.device), seqs


# ---- attention ----
def attend(attn, x: torch.Tensor, positions: torch.Tensor, seqs: list[SeqSlice], layer: int) -> torch.Tensor:
    """x: [N, D] normed block input of all sequences' new tokens; positions: [N]. Returns [N, D]."""
    q, kv, comp, idx, (cos, sin) = attn.project(x, attn.rope(positions))
    out = torch.empty_like(q)
    for s in seqs:
        rows = slice(s.start, s.end)
        out[rows] = _attend_one(attn, q[rows], kv[rows], positions[rows], s.first_pos, s.layers[layer],
                                [t[rows] for t in comp], [t[rows] for t in idx])
    return attn.output(out, cos, sin)


def _attend_one(attn, q, kv, positions, first_pos: int, state: LayerState, comp, idx) -> torch.Tensor:
    """One sequence's T new tokens: q [T, H, d], kv [T, d]; updates `state` in place."""
    keys, visible = window_keys(attn, state, kv, positions, first_pos, positions)   # [K, d], [T, K]
    if attn.compressor is not None:
        entries = _append_entries(attn, pool(attn.compressor, *comp, first_pos, state.compressor, attn.rope),
                                  state.compressor, attn.quantize_entry)
        if attn.indexer is not None:
            index_kv, index_gate, index_q, index_w = idx
            keys_i = _append_entries(attn, pool(attn.indexer.compressor, index_kv, index_gate, first_pos,
                                                state.indexer, attn.rope), state.indexer, attn.quantize_index)
            shown = select(attn.indexer, index_q, index_w, keys_i, positions)
        else:
            shown = visible_entries(positions, entries.shape[0], attn.ratio)
        keys = torch.cat([keys, entries.to(keys.dtype)])
        visible = torch.cat([visible, shown], dim=1)
    return sink_attention(q, keys, visibility_bias(visible), attn.attn_sink, attn.head_dim ** -0.5)


def _append_entries(attn, new: torch.Tensor, state: CompressorState, quantize) -> torch.Tensor:
    new = attn.final_entries(new, quantize)
    state.entries = new if state.entries is None else torch.cat([state.entries, new])
    return state.entries


# ---- compressor and indexer ----
def pool(comp, kv: torch.Tensor, gate: torch.Tensor, start: int, state: CompressorState, rope) -> torch.Tensor:
    """Feed one sequence's new tokens (absolute positions start..start+T-1) to compressor `comp`; return the
    entries of the windows they close, [n_closed, d] fp32 (normed and roped, before any QAT step)."""
    r, d = comp.ratio, comp.head_dim
    score = upcast(gate)                      # the pooling score without ape[slot], which comp.entries adds
    kv = upcast(kv)
    if state.pending_kv is not None:
        start -= state.pending_kv.shape[0]
        kv, score = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_score, score])
    n_closed = kv.shape[0] // r
    state.pending_kv, state.pending_score = kv[n_closed * r:], score[n_closed * r:]
    if n_closed == 0:
        return kv.new_zeros(0, d)
    kv = kv[: n_closed * r].view(n_closed, r, -1)
    score = score[: n_closed * r].view(n_closed, r, -1)
    prev_a = _predecessors(comp, kv, score, state) if comp.overlap else None
    return comp.entries(kv, score, prev_a, (torch.arange(n_closed, device=kv.device) + start // r) * r, rope)


def _predecessors(comp, kv: torch.Tensor, score: torch.Tensor, state: CompressorState):
    """[n, r, 2d] closed windows -> the A halves [n, r, d] (kv, score) of each one's predecessor; keeps the
    last window's A halves in `state`. Window 0's missing predecessor weighs zero (kv 0, score -inf)."""
    d = comp.head_dim
    a_kv, a_score = kv[..., :d], score[..., :d]
    if state.prev_a_kv is None:
        prev_kv, prev_score = torch.zeros_like(a_kv[:1]), torch.full_like(a_score[:1], float("-inf"))
    else:
        prev_kv, prev_score = state.prev_a_kv.unsqueeze(0), state.prev_a_score.unsqueeze(0)
    state.prev_a_kv, state.prev_a_score = a_kv[-1], a_score[-1]
    return torch.cat([prev_kv, a_kv[:-1]]), torch.cat([prev_score, a_score[:-1]])


def select(indexer, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
           positions: torch.Tensor) -> torch.Tensor:
    """q [T, h, dI], weights [T, h] of queries at positions [T]; keys [n, dI] (one sequence) or [T, n, dI]
    (each query its own) -> [T, n] bool of selected entries: the top-k visible by index_scores."""
    n = keys.shape[-2]
    if n == 0:
        return torch.zeros(q.shape[0], n, dtype=torch.bool, device=q.device)
    visible = visible_entries(positions, n, indexer.ratio)
    return top_k_mask(index_scores(q, weights, keys).masked_fill(~visible, float("-inf")), indexer.topk)
