"""Context-parallel prefill: one long prompt's positions split over C ranks, token-interleaved (docs/parallel.md).

Rank c of the C computes the rows at positions p = c (mod C): their queries, the indexer's scoring, the attention,
the output projection, mHC and the MoE. A layer that mixes positions reads its input through
ForwardBatch.all_rows, which here all-gathers every rank's normed attention input (one collective per layer);
from it every rank computes the per-token K=V latents and compressor projections of all positions and writes the
whole layer state (window ring, compressed entries, indexer keys, open windows) into its own pools, exactly as one
rank would. Each query's keys (its window and its selected entries) are then all on its rank, so its attention is
one softmax with the sink in it once: no partials to merge. After the prefill every rank of the group holds the
single-rank state of the sequence; the request's decoding rank keeps it, the others free the slot.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.table import use

from ..errors import DeepInferError
from .ranks import Ranks


class TokenInterleave:
    """The rows of one segment (positions start .. start + n - 1) shared over the ranks by position: rank c
    computes the rows at positions p = c (mod C). A ForwardBatch's `row_share`."""

    def __init__(self, ranks: Ranks, start: int, n: int, device: torch.device):
        c, size = ranks.rank, ranks.size
        self.ranks = ranks
        self.rows = torch.arange((c - start) % size, n, size, device=device)         # [Q] this rank's rows
        self.per_rank = -(-n // size)                                                # rows a rank sends (padded)
        i = torch.arange(n, device=device)
        # row i is row i // C of its owner (start + i) % C: its place in the rank-major gather of padded blocks
        self.order = ((start + i) % size) * self.per_rank + i // size                # [N]

    def owner(self, row: int, start: int) -> int:
        return (start + row) % self.ranks.size

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [Q, ...] of this rank's rows -> [N, ...] of every row, in position order (one all-gather)."""
        block = x.new_zeros(self.per_rank, *x.shape[1:])
        block[:x.shape[0]] = x
        return self.ranks.all_gather(block)[self.order]


@torch.inference_mode()
def prefill(runner, ranks: Ranks, slot: int, start: int, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill tokens [n] (positions start .. start + n - 1) of the sequence in `slot` of runner's pools over the
    ranks, each computing its interleaved share (runner: runner/runner.ModelRunner, which builds the step) -> the
    last position's logits [V] fp32, on every rank. Every rank calls it with the same tokens and start (slot and
    block table may differ: each writes its own pools), holding the sequence's state up to `start`; afterwards each
    holds it up to start + n, as a one-rank prefill leaves it."""
    n = tokens.shape[0]
    if n < ranks.size:
        raise DeepInferError(f"a context-parallel prefill of {n} tokens over {ranks.size} ranks leaves a rank without "
                             f"a position: prefill prompts this short on one rank")
    share = TokenInterleave(ranks, start, n, tokens.device)
    hidden = runner.shared_forward(slot, start, tokens, share)                      # [Q, D]
    owner = share.owner(n - 1, start)
    mine = ranks.rank == owner                    # the last position is its owner's last row
    logits = runner.model.logits(hidden[-1:] if mine else hidden[:0])               # [1 or 0, V] fp32
    return ranks.broadcast(logits[0] if mine else logits.new_empty(logits.shape[-1]), owner)


def prefill_prompts(engine, ranks: Ranks, group: Ranks, prompts: list[list], min_tokens: int) -> dict[str, int]:
    """Before a generate's step loop. prompts[i]: the requests of prompt i, which rank i mod N owns (attention data
    parallelism). Each request of a prompt of more than min_tokens tokens whose owner is in this rank's group
    (`group`, ranks.split(C)) gets all but its last prompt token prefilled over the group; the step that feeds the
    last token then samples the first output as one rank would. A request asking for prompt logprobs needs every
    position's logits and is left to its owner. Returns {request id: positions held} of this rank's requests
    prefilled so; the other ranks of the group free their copy at once."""
    computed = {}
    try:
        with use(engine.kernels):
            for i, reqs in enumerate(prompts):
                owner = i % ranks.size
                if owner // group.size != ranks.rank // group.size:
                    continue
                for req in reqs:
                    n = len(req.prompt_ids) - 1
                    if n < max(min_tokens, group.size) or req.params.prompt_logprobs is not None:
                        continue                                # every rank decides alike: the same requests
                    if _prefill_request(engine, group, req, n, ranks.rank == owner):
                        computed[req.request_id] = n
    except BaseException:
        for rid in computed:                    # nothing was added to the engine yet: give the seats back
            engine.manager.release(rid)
        raise
    return computed


def _prefill_request(engine, group: Ranks, req, n: int, mine: bool) -> bool:
    """The first n prompt positions of `req` over the group into each rank's pools; the owner keeps them (True)."""
    manager = engine.manager
    rid = req.request_id if mine else f"context-parallel:{req.request_id}"
    held = manager.reserve(rid, n)
    if group.any(not held):                 # a rank without room: the owner prefills it alone, in its steps
        if held:
            manager.release(rid)
        return False
    try:
        tokens = torch.tensor(req.prompt_ids[:n], dtype=torch.long).to(engine.runner.model.device)
        prefill(engine.runner, group, manager.slot(rid), 0, tokens)
    except BaseException:
        manager.release(rid)
        raise
    if not mine:
        manager.release(rid)
    return mine
