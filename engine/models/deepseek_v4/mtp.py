"""DeepSeek-V4's NextN (MTP) layer as a drafter over the state pools: k draft steps reusing `mtp.0`.

The layer (model.MTPLayer) maps (the target's last streams at position t, the token at t+1) to a prediction
for t+2, through one sliding-window block whose window ring holds one K=V latent per position t. Two state kinds:
  mtp.0.window   [S, W, d]      the layer's window: the latent of the row (streams at t, token t+1) at position t
  mtp.streams    [S, 1, hc*D]   the target's last streams at the newest position (what a chunk's first row pairs
                                with its own token, one position on)
Every target step (ForwardBatch.draft_rings) a row at position t with input token x_t writes the latent of
(streams at t-1, x_t) at t-1 (the row before it in its segment, or `mtp.streams` for a segment's first row),
then its own streams into `mtp.streams`. So after a verify step the window holds exact latents up to the last
accepted position minus one, whatever was rejected (a rejected row's latent is rewritten before any read).

Drafting at anchor p (the last accepted input position) with the committed token y for p+1:
  step 1  (streams at p, y)          at position p    -> logits for p+2 -> d_1
  step k  (step k-1's out, d_{k-1})  at position p+k-1 -> logits for p+k+1 -> d_k
Each step writes its latent at its position (step 1's is exact; later ones are the chain's own, overwritten by
the target's next step before anything else reads them) and attends to the window up to it. A draft's confidence
is its probability under the layer's distribution at temperature 1 (V4 has no confidence head): the prefix
survival products the verify schedule ranks by. Checkpoints with more NextN layers draft with `mtp.0` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.forward_batch import ForwardBatch
from ...cache.pools import SCRATCH
from ...cache.spec import Ring

MAX_STEPS = 5              # drafts a block proposes at most (the upstream draft cap's default)
LAYER = "mtp.0"
STREAMS = "mtp.streams"
RINGS = (f"{LAYER}.window", STREAMS)   # the drafter's rings (state_kinds), written by target steps with draft_rings


@dataclass
class MTPDrafts:
    tokens: torch.Tensor       # [R, k] drafts for positions p+2 .. p+k+1
    confidence: torch.Tensor   # [R, k] each draft's probability under the layer's distribution (temperature 1)

    def acceptance_confidence(self) -> torch.Tensor:
        return self.confidence


def state_kinds(model) -> list:
    """The drafter's per-sequence state: the layer's window ring and the last target streams."""
    cfg = model.cfg
    return [*model.mtp[0].attn.state_kinds(LAYER), Ring(STREAMS, 1, cfg.hc_mult * cfg.hidden_size)]


def ring_depth(name: str, final: int) -> int:
    """Ring.depth of the drafter's rings: the streams ring holds the target's last streams (depth `final`, the
    whole stack's); the window's latent at t-1 pairs them with the token at t (one position further back)."""
    return final if name == STREAMS else final + 1


def observe(model, streams: torch.Tensor, input_ids: torch.Tensor, batch: ForwardBatch) -> None:
    """After the target's layers: streams [N, hc, D] of the step's rows, input_ids [N]. Writes the latent of
    (streams at t-1, x_t) at t-1 for each row at t (each segment's last window positions), then each row's
    streams into mtp.streams."""
    layer, pools = model.mtp[0], batch.pools
    window, last = pools.rings[f"{LAYER}.window"], pools.rings[STREAMS]
    span = window.shape[1]
    rows = batch.last_rows(span)                                               # [M] rows whose latents stay
    pos, start, slot = batch.positions[rows], batch.row_start[rows], batch.row_slot[rows]
    held = last[slot, (pos - 1) % last.shape[1]].view(-1, *streams.shape[1:])  # the position before, from the ring
    prev = torch.where((pos > start).view(-1, 1, 1), streams[(rows - 1).clamp(min=0)], held)
    kv = layer.window_latent(layer.combine(model.embed(input_ids[rows]), prev),
                             layer.attn.rope((pos - 1).clamp(min=0)))          # [M, d] at positions t-1
    keep = (pos >= 1) & (pos - 1 >= batch.row_end[rows] - 1 - span)
    window[torch.where(keep, slot, SCRATCH), (pos - 1) % span] = kv.to(window.dtype)
    batch.write_ring(last, streams.flatten(1))


def draft(model, pools, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, sample,
          steps: int) -> MTPDrafts:
    """`steps` draft steps per row r: slot slots[r] [R] holds the target up to positions[r] = p, tokens [R] the
    target's token for p+1; sample(i, logits [R, V] fp32) -> draft i [R] (position p+2+i). Static shapes."""
    layer = model.mtp[0]
    last = pools.rings[STREAMS]
    h = last[slots, positions % last.shape[1]].view(slots.shape[0], model.cfg.hc_mult, -1)   # streams at p
    tok, drafts, conf = tokens, [], []
    for i in range(steps):
        batch = ForwardBatch.uniform(pools, slots, positions + i, 1, 1)
        h = layer(layer.combine(model.embed(tok), h), tok,
                  lambda x, batch=batch: layer.attn(x, batch, LAYER))
        logits = model.head.fp32(layer.collapse(h)).float()                       # [R, V]
        tok = sample(i, logits)
        drafts.append(tok)
        conf.append(torch.softmax(logits, dim=-1).gather(1, tok.unsqueeze(1)).squeeze(1))
    return MTPDrafts(torch.stack(drafts, 1), torch.stack(conf, 1))
