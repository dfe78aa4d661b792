"""A point's prefix-cache fields: what the engine's cache hit (EngineStats' prefix counts over the timed
requests) beside the ideal, the tokens a perfect block cache could serve: the whole blocks of each prompt that an
earlier-sent request (its prompt, and its output in a conversation) already held, at most the prompt less one
token. The ideal ignores that requests running at once cannot share what neither has computed yet, and that
bounded replay makes hits of at most R positions not worth taking (docs/prefix-cache.md)."""

from __future__ import annotations

import hashlib
from array import array

FIELDS = ("prefix_caching", "prefix_queried_tokens", "prefix_hit_tokens", "prefix_hit_rate", "prefix_ideal_tokens",
          "prefix_ideal_rate", "prefix_replayed_tokens", "prefix_evicted_blocks", "prefix_snapshot_hits",
          "prefix_replay_tokens", "prefill_tokens_computed")


def ideal_hits(sequences: list[list[int]], prompts: list[list[int]], block_tokens: int) -> list[int]:
    """Per prompt (in send order; sequences[i] is the tokens request i computed: its prompt, or its prompt and
    output less the last output token): the positions of its whole blocks an earlier request's sequence began with."""
    seen: set[bytes] = set()
    out = []
    for prompt, seq in zip(prompts, sequences):
        hit, parent = 0, b""
        for k in range((len(prompt) - 1) // block_tokens):
            parent = _chain(parent, prompt[k * block_tokens:(k + 1) * block_tokens])
            if parent not in seen:
                break
            hit += block_tokens
        out.append(hit)
        parent = b""
        for k in range(len(seq) // block_tokens):
            parent = _chain(parent, seq[k * block_tokens:(k + 1) * block_tokens])
            seen.add(parent)
    return out


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_fields(stats, prompts: list[list[int]], sequences: list[list[int]], before: list[list[int]] = ()
                  ) -> dict:
    """Row fields (FIELDS) from the engine's stats over the timed requests, what they sent and what each left in
    the state; `before`: the warm-up's prompts, sent first. prefill_tokens_computed: prompt positions run (the
    prompts less the hits plus their replays; recomputes after a preemption not counted)."""
    sent = sum(len(p) for p in prompts)
    before = list(before)
    ideal = sum(ideal_hits(before + list(sequences), before + list(prompts), stats.block_tokens)[len(before):]) \
        if stats.block_tokens else 0
    hit, replayed = (stats.prefix_hit_tokens or 0), (stats.prefix_replayed_tokens or 0)
    return {"prefix_caching": bool(stats.prefix_caching), "prefix_queried_tokens": stats.prefix_queried_tokens,
            "prefix_hit_tokens": stats.prefix_hit_tokens, "prefix_hit_rate": stats.prefix_hit_rate,
            "prefix_ideal_tokens": ideal, "prefix_ideal_rate": ideal / sent if sent else None,
            "prefix_replayed_tokens": stats.prefix_replayed_tokens,
            "prefix_evicted_blocks": stats.prefix_evicted_blocks, "prefix_snapshot_hits": stats.prefix_snapshot_hits,
            "prefix_replay_tokens": stats.prefix_replay_tokens,
            "prefill_tokens_computed": sent - hit + replayed}
