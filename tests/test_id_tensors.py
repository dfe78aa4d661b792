"""The penalties' host id cache (engine/sampling/id_tensors.py): each list's ids as converted now, grown by what was
appended, converted again when the list shrank or its last converted id changed, bounded in ids and lists; and
the step's penalty tensors with the cache equal those converted afresh, step after step."""

from __future__ import annotations

import random

import numpy as np
import torch

from deepinfer.sampling import SamplingParams, sampler
from deepinfer.sampling.id_tensors import IdTensors


def _same(cache, ids):
    got = cache(ids)
    return got.dtype == np.int64 and got.tolist() == ids


def test_lists_grow_shrink_and_change():
    cache, ids = IdTensors(), [5, 6]
    assert _same(cache, ids) and cache.held == 2
    for step in range(40):                               # appends: grown in place, the buffer doubling
        ids.extend([step] * (step % 3))
        assert _same(cache, ids)
    assert cache.held >= len(ids) and len(cache._entries) == 1
    del ids[10:]                                         # shorter than converted: converted again
    assert _same(cache, ids)
    ids[-1] = 999                                        # the last converted id changed: converted again
    assert _same(cache, ids)
    empty = []
    assert _same(cache, empty)
    empty.append(3)
    assert _same(cache, empty)
    assert cache.held == sum(e[1].shape[0] for e in cache._entries.values())


def test_bounded_in_ids_and_lists_least_recent_first():
    cache = IdTensors(capacity=100, max_lists=3)
    lists = [[i] * 30 for i in range(5)]
    for ids in lists[:3]:
        cache(ids)
    cache(lists[0])                                      # the most recent now; lists[1] is the oldest
    cache(lists[3])                                      # 120 ids > 100: the oldest goes
    assert id(lists[1]) not in cache._entries and id(lists[0]) in cache._entries
    assert cache.held <= 100
    cache(lists[4])
    assert len(cache._entries) <= 3 and cache.held <= 100
    assert all(_same(cache, ids) for ids in lists)       # evicted lists come back converted
    assert IdTensors(capacity=10)(list(range(50))).tolist() == list(range(50))   # one list over the bound is kept


def test_penalty_tensors_with_the_cache_equal_fresh_ones_as_outputs_grow(monkeypatch):
    vocab, b = 40, 6
    rng = random.Random(0)
    params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.1) for _ in range(b)]
    prompts = [[rng.randrange(vocab + 3) for _ in range(rng.randrange(0, 20))] for _ in range(b)]
    outs = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 5))] for _ in range(b)]
    monkeypatch.setattr(sampler, "REQUEST_IDS", IdTensors())
    for step in range(12):
        for o in outs:
            o.extend(rng.randrange(-1, vocab + 2) for _ in range(rng.randrange(0, 3)))   # ids outside V too
        if step == 7:
            outs[2] = outs[2][:1]                        # a request's list replaced (another object)
        cached = sampler.build_sampling_tensors(params, list(range(b)), [0] * b, vocab, "cpu", prompts, outs)
        fresh = [sampler._per_row_ids(rows, vocab, "cpu") for rows in (prompts, outs)]
        assert torch.equal(cached.prompt_mask, fresh[0] > 0) and torch.equal(cached.output_counts, fresh[1])
    held = sampler.REQUEST_IDS._entries                  # every non-empty list the steps read, the replaced one too
    assert {id(ids) for ids in prompts + outs if ids} < set(held) and len(held) <= 2 * b + 1
