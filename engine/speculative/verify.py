"""The commit rule of a sampled row.

A row samples num_logits = q + 1 positions: the newest committed token and q draft tokens d_1..d_q after it.
Its samples s_0..s_q are what the target model draws at each of those positions (s_i follows d_1..d_i). Draft
d_{i+1} is accepted while it equals s_i; the first mismatch s_a replaces d_{a+1} and everything after it is
discarded, so a row commits s_0..s_a: 1..q+1 tokens (q = 0, a normal row: exactly s_0). The committed tokens
are the ones one-at-a-time decoding would have drawn, because a draw depends only on its context and its
position (the sampler's noise is counter-based on (seed, position, id), never on the step)."""

from __future__ import annotations


def committed_tokens(sampled: list[int], drafts: list[int]) -> list[int]:
    """sampled: s_0..s_q (q + 1 ids); drafts: d_1..d_q. Returns s_0..s_a, a = the number of accepted drafts."""
    if len(sampled) != len(drafts) + 1:
        raise ValueError(f"a verify row of {len(drafts)} drafts samples {len(drafts) + 1} positions, "
                         f"got {len(sampled)}")
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return sampled[:a + 1]
