"""The V4.1 oracle: the model's blocks over one SequenceState per sequence, tensors growing by concatenation, with
YOCO truncation (`last_only`) and the DSpark features the drafter reads.

The runtime forward (models/deepseek_v41) runs the same blocks over the state pools; tests compare the two. Here a
KV source closes one sequence's groups from its open window (CompressorState.pending_*) and hands its entries to
the later layers of the group through `SeqRows.shared`; an index source scores every visible key of the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.kernels.attention import sink_attention
from deepinfer.kernels.indexer import index_scores

from ..models.common.mhc import hc_collapse
from ..models.common.selection import top_k_mask
from ..models.deepseek_v41.csa2 import block_entries, candidate_block_mask
from .common import visibility_bias, visible_entries, window_keys
from .state import CompressorState, LayerState, SequenceState

QUERY_BLOCK = 1024   # indexer queries scored at a time


@dataclass
class SeqRows:
    """One sequence's rows [start, end) of a layer's input; rows [q_start, end) need outputs.
    Row i holds position pos0 + (i - start); the window state ends at position prev_tokens - 1."""
    start: int
    end: int
    q_start: int
    pos0: int
    prev_tokens: int
    state: SequenceState
    shared: dict = field(default_factory=dict)   # CSA2 products of the current source group


@dataclass
class ForwardOutput:
    hidden: torch.Tensor                  # [M, D] final normed hidden of the output rows
    rows: torch.Tensor                    # [M] their indices into the input rows
    features: torch.Tensor | None = None  # [F, n_targets*D] DSpark target features
    feature_rows: torch.Tensor | None = None


def new_state(model) -> SequenceState:
    return SequenceState(layers=[_layer_state(b.attn) for b in model.layers], mtp=[LayerState() for _ in model.mtp])


def _layer_state(attn) -> LayerState:
    src = attn.compressor is not None
    return LayerState(compressor=CompressorState() if src else None,
                      indexer=CompressorState() if src and attn.indexer is not None else None)


def forward_reference(model, input_ids: torch.Tensor, chunks: list[tuple[int, int]], states: list[SequenceState],
                      last_only: bool = False, feature_window: int = 0) -> ForwardOutput:
    """input_ids [N]: new tokens of len(states) sequences, sequence i owning rows chunks[i].
    last_only: only each chunk's last row needs an output (YOCO truncation).
    feature_window > 0: also return DSpark features for each chunk's last `feature_window` rows."""
    cfg = model.cfg
    positions, seqs = _claim_positions(model, chunks, states)
    hash_ids = _hash(model, input_ids, chunks, states)
    h, pre_mix = model.embed_streams(input_ids)
    rows = torch.arange(input_ids.shape[0], device=model.device)       # current rows -> input rows
    targets = list(cfg.dspark_target_layer_ids) if feature_window else []
    features = {}
    last_pos = [s.pos0 + s.end - s.start - 1 for s in seqs]
    for i, block in enumerate(model.layers):
        if block.engram is not None:
            h = block.engram(h, hash_ids[rows, block.engram.layer_index])
        if i in targets:
            features[i] = (rows, h.mean(dim=1))
        qrows = None
        if last_only and i >= cfg.truncation_start:
            span = (cfg.num_hidden_layers - 1 - i) * (cfg.sliding_window - 1)
            qrows = _query_rows(model, seqs, [t - span for t in last_pos])
        h, pre_mix = block(h, pre_mix, lambda x: attend(block.attn, x, positions, seqs), qrows)
        if qrows is not None:
            rows, positions = rows[qrows], positions[qrows]
            seqs = _shrink(seqs)
    hidden = model.norm(hc_collapse(h, pre_mix))
    out = ForwardOutput(hidden, rows)
    if targets:
        out.features, out.feature_rows = _features(model, features, chunks, feature_window, input_ids.shape[0])
    return out


def all_logits(model, input_ids: torch.Tensor, chunks: list[tuple[int, int]],
               states: list[SequenceState]) -> torch.Tensor:
    """forward_reference, then every row's logits [N, vocab]."""
    return model.logits(forward_reference(model, input_ids, chunks, states).hidden)


# ---- row bookkeeping ----
def _claim_positions(model, chunks, states) -> tuple[torch.Tensor, list[SeqRows]]:
    pos, seqs = [], []
    for (start, end), st in zip(chunks, states):
        first = st.num_tokens
        st.num_tokens = first + end - start
        pos.append(torch.arange(first, first + end - start))
        seqs.append(SeqRows(start, end, start, first, first, st))
    return torch.cat(pos).to(model.device), seqs


def _query_rows(model, seqs: list[SeqRows], cut: list[int]) -> torch.Tensor:
    """Mark rows at or after each sequence's cut position as query rows; returns their indices."""
    keep = []
    for s, c in zip(seqs, cut):
        s.q_start = s.start + min(max(c - s.pos0, 0), s.end - s.start - 1)
        keep.append(torch.arange(s.q_start, s.end))
    return torch.cat(keep).to(model.device)


def _shrink(seqs: list[SeqRows]) -> list[SeqRows]:
    """After a truncated layer the query rows become the next layer's input rows."""
    out, start = [], 0
    for s in seqs:
        n = s.end - s.q_start
        out.append(SeqRows(start, start + n, start, s.pos0 + s.q_start - s.start, s.prev_tokens, s.state,
                           s.shared))
        start += n
    return out


def _features(model, features: dict, chunks, window: int, n_rows: int):
    """DSpark input: per chunk, its last `window` rows of the streams entering each target layer,
    averaged over the hc streams and concatenated -> ([F, n_targets*D], input row indices [F])."""
    want = torch.zeros(n_rows, dtype=torch.bool, device=model.device)
    for start, end in chunks:
        want[max(start, end - window):end] = True
    parts = []
    for layer in model.cfg.dspark_target_layer_ids:
        rows, feat = features[layer]
        parts.append(feat[want[rows]])
    return torch.cat(parts, dim=-1), want.nonzero().squeeze(1)


def _hash(model, input_ids: torch.Tensor, chunks, states) -> torch.Tensor | None:
    """Engram hash ids [N, L, C] of the new rows, each sequence continuing its look-back (SequenceState.engram)."""
    if not model.cfg.engram_layer_ids:
        return None
    hasher = model.bound_hasher()
    before = [hasher.new_state(model.device) if st.engram is None else st.engram for st in states]
    ids, after = hasher.hash_ids_flat(input_ids, chunks, before)
    for st, new in zip(states, after):
        st.engram = new
    return ids


# ---- attention ----
def attend(attn, x: torch.Tensor, positions: torch.Tensor, seqs: list[SeqRows]) -> torch.Tensor:
    """x [I, D] normed input rows, positions [I] -> outputs [Q, D] for each sequence's query rows."""
    qrows = torch.cat([torch.arange(s.q_start, s.end) for s in seqs]).to(x.device)
    xq, qpos = x[qrows], positions[qrows]
    rope = attn.rope            # the block passes the compress rope to layers with ratio > 0
    cos_q, sin_q = rope(qpos)
    q, qr = attn.queries(xq, cos_q, sin_q)
    kv = attn.window_kv(x, *rope(positions))
    index_q = attn.indexer.queries(qr, xq, cos_q, sin_q, attn.qat_fake_quant) if attn.indexer else None
    out = torch.empty_like(q)
    done = 0
    for s in seqs:
        tq = s.end - s.q_start
        rows = slice(done, done + tq)
        iq = None if index_q is None else (index_q[0][rows], index_q[1][rows])
        out[rows] = _attend_one(attn, s, q[rows], qpos[rows], x[s.start:s.end], kv[s.start:s.end],
                                positions[s.start:s.end], iq)
        done += tq
    return attn.output(out, cos_q, sin_q)


def _attend_one(attn, s: SeqRows, q, qpos, x, kv, kv_pos, index_q) -> torch.Tensor:
    """One sequence: q [Tq, H, d] at qpos; kv [T, d] at kv_pos (its new rows)."""
    st = s.state.layers[attn.layer]
    keys, visible = window_keys(attn, st, kv, kv_pos, s.prev_tokens, qpos)          # [K, d], [Tq, K]
    if attn.ratio:
        sh = s.shared
        if attn.compressor is not None:
            _publish(attn, st, x, sh)
        if attn.indexer is not None and sh.get("keys") is not None:
            _select(attn, sh, index_q, qpos)
        entries = sh.get("entries")
        if entries is not None and entries.shape[0]:
            chosen = sh.get("selected")
            chosen = torch.zeros(q.shape[0], entries.shape[0], dtype=torch.bool, device=q.device) \
                if chosen is None else chosen[-q.shape[0]:]
            keys = torch.cat([keys, entries.to(keys.dtype)])
            visible = torch.cat([visible, chosen], dim=1)
    return sink_attention(q, keys, visibility_bias(visible), attn.attn_sink, attn.head_dim ** -0.5)


def _publish(attn, st: LayerState, x: torch.Tensor, sh: dict) -> None:
    """KV source: close the groups x completes, append entries (and index keys); the group's
    products replace the previous group's."""
    latents = _latents(attn.compressor, x, st.compressor)
    n0 = st.compressor.num_entries()
    entries, keys = attn.compress(latents, (n0 + torch.arange(latents.shape[0], device=x.device)) * attn.ratio)
    st.compressor.entries = _append(st.compressor.entries, entries)
    if st.indexer is not None:
        st.indexer.entries = _append(st.indexer.entries, keys)
    sh.clear()
    sh["entries"], sh["keys"] = st.compressor.entries, None if st.indexer is None else st.indexer.entries


def _latents(comp, x: torch.Tensor, state: CompressorState) -> torch.Tensor:
    """One sequence's new tokens x [T, D] (continuing `state`) through KV-source compressor `comp` -> latents of
    the groups they close, [n_closed, d] pre-RoPE in x's dtype. Leftover tokens wait in state.pending_*."""
    if comp.wgate is None:
        return comp.norm(comp.wkv(x))
    kv, gate = comp.project(x)                                           # [T, d] each, >= fp32
    if state.pending_kv is not None:
        kv, gate = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_score, gate])
    r = comp.ratio
    n = kv.shape[0] // r
    state.pending_kv, state.pending_score = kv[n * r:], gate[n * r:]
    kv, gate = kv[: n * r].view(n, r, kv.shape[-1]), gate[: n * r].view(n, r, gate.shape[-1])
    return comp.pool(kv, gate, x.dtype)


def _select(attn, sh: dict, index_q, qpos: torch.Tensor) -> None:
    """Index source: top-k of the group's keys for these queries (inside the candidates, if any). Scored in
    blocks of queries so the [queries, heads, entries] scores stay bounded on long prefills."""
    t = qpos.shape[0]
    inside = _inside(attn, sh, t)
    chosen, candidates = [], []
    for a in range(0, t, QUERY_BLOCK):
        rows = slice(a, a + QUERY_BLOCK)
        scores = _index_scores(attn.indexer, index_q[0][rows], index_q[1][rows], sh["keys"], qpos[rows], attn.ratio)
        keep, cand = _pick(attn, scores, qpos[rows], None if inside is None else inside[rows])
        chosen.append(keep)
        candidates.append(cand)
    if attn.is_candidate_source:
        sh["candidates"] = torch.cat(candidates)
    sh["selected"] = torch.cat(chosen)


def _inside(attn, sh: dict, t: int) -> torch.Tensor | None:
    """The candidate mask [t, n] this index source selects inside, for the group's last t queries (None:
    no candidates apply: the candidate source itself, an index source before it, or none published)."""
    inside = sh.get("candidates") if attn.uses_candidates and not attn.is_candidate_source else None
    return None if inside is None else inside[-t:]


def _pick(attn, scores: torch.Tensor, qpos: torch.Tensor, inside: torch.Tensor | None
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Index source: scores [T, n] (-inf: not visible) of queries at qpos [T] -> (top-k mask [T, n],
    the candidate source's candidate mask [T, n], else None)."""
    candidates = None
    if attn.is_candidate_source:
        keep = candidate_block_mask(scores, qpos, attn.ratio, attn.candidate_blocks, attn.candidate_block_size)
        candidates = block_entries(keep, attn.candidate_block_size, scores.shape[1])
    elif inside is not None:
        scores = scores.masked_fill(~inside, float("-inf"))
    return top_k_mask(scores, attn.indexer.topk), candidates


def _index_scores(indexer, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                  ratio: int) -> torch.Tensor:
    """One sequence: q [T, H_I, dI], weights [T, H_I], keys [n, dI], positions [T] -> [T, n], -inf where not
    yet visible."""
    s = index_scores(q, weights, keys, indexer.index_dim ** -0.5)
    return s.masked_fill(~visible_entries(positions, keys.shape[-2], ratio), float("-inf"))


def _append(old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if old is None else torch.cat([old, new])
