"""Engram (DeepSeek-V4.1 n-gram hash memory): layout, multipliers, compressed map, hashing, module."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models

from deepinfer.config.deepseek_v41 import DeepseekV41Config, engram_prime_layout
from deepinfer.models.deepseek_v41.engram import (BLOCKED, Engram, EngramHasher, bucket_offsets, compressed_token_map,
                                     dequantize_engram_rows, engram_layout, hash_multipliers)

SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]


def _byte_level(text: str) -> str:
    """GPT-2 byte-to-unicode spelling of a text (how byte-level BPE vocabularies store tokens)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return "".join(table[b] for b in (text.encode() if isinstance(text, str) else text))


# (decoded text or raw bytes, expected compressed id)
HAND_VOCAB = [
    (SPECIALS[0], 0), (SPECIALS[1], 1), (SPECIALS[2], 2),   # specials kept, each its own key
    ("The", 3), (" the", 3), ("THE", 3),                    # lowercase + strip
    ("café", 4), ("cafe", 4), ("ÉCOLE", 5), (" école", 5),  # accents stripped (NFD)
    (" ", 6), ("  ", 6), ("\n", 6), ("\u3000", 6),          # whitespace runs -> one kept space; NFKC space
    ("ﬁ", 7), ("fi", 7),                                    # NFKC ligature
    ("A\tB", 8), ("a  b ", 8),                              # inner whitespace run -> one space
    ("\u0301", 9), ("\u0300", 10),                          # normalizes to "": keyed by the raw text
    (b"\xc3", 11), (b"\xc2", 12),                           # partial UTF-8: keyed by the raw token string
    ("x", 13), ("X", 13),
]


def hand_tokenizer() -> Tokenizer:
    raw = [t if t in SPECIALS else _byte_level(t) for t, _ in HAND_VOCAB]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(raw)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return tok


HAND_MAP = [c for _, c in HAND_VOCAB]
HAND_SIZE = 14


def small_cfg(max_ngram=4, heads=3, **kw) -> DeepseekV41Config:
    base = dict(engram_layer_ids=(1, 3), engram_vocab_size=50, engram_max_ngram_size=max_ngram,
                engram_n_heads=heads, engram_head_dim=32, engram_pad_id=2, engram_compressed_vocab_size=HAND_SIZE,
                vocab_size=len(HAND_VOCAB) + 3, hidden_size=16, hc_mult=4)
    base.update(kw)
    return DeepseekV41Config(**base)


# --------------------------------------------------------------------------- layout

def _sieve_primes(lo: int, hi: int) -> list[int]:
    """Primes in [lo, hi) by a segmented sieve (independent of sympy)."""
    small = np.ones(int(hi ** 0.5) + 2, dtype=bool)
    small[:2] = False
    for i in range(2, int(len(small) ** 0.5) + 1):
        small[i * i::i] = False
    seg = np.ones(hi - lo, dtype=bool)
    for p in np.flatnonzero(small):
        seg[max(p * p, (lo + p - 1) // p * p) - lo::p] = False
    return (np.flatnonzero(seg) + lo).tolist()


def test_released_layout_reproduces_table_rows():
    cfg = DeepseekV41Config(engram_layer_ids=(1, 14), engram_vocab_size=16_000_000, engram_max_ngram_size=4,
                            engram_n_heads=8, engram_num_embeddings=(384006168, 384016682))
    t0 = time.perf_counter()
    primes = engram_layout(cfg)          # raises if the rows disagree with engram_num_embeddings
    elapsed = time.perf_counter() - t0
    assert [sum(sum(o) for o in layer) for layer in primes] == [384006168, 384016682]
    assert elapsed < 2.0, elapsed
    # independent: every order of every layer takes the next 8 primes above 16e6 not taken before,
    # i.e. the 48 primes above 16e6 in order, 8 at a time
    flat = [p for layer in primes for o in layer for p in o]
    assert flat == _sieve_primes(16_000_000, 16_002_000)[:48]
    assert flat[0] == 16000057
    assert [list(map(list, layer)) for layer in primes] == engram_prime_layout(16_000_000, 2, 4, 8)


def test_bucket_offsets():
    assert bucket_offsets(((5, 7), (11, 13))) == [0, 5, 12, 23]


def test_hash_multipliers():
    vocab = 99092
    bound = (np.iinfo(np.int64).max // vocab) // 2
    m = hash_multipliers((1, 14), 4, vocab)
    assert m.dtype == np.int64 and m.shape == (2, 4)
    assert (m % 2 == 1).all() and (m > 0).all() and (m < 2 * bound + 1).all()
    assert (hash_multipliers((1, 14), 4, vocab) == m).all()           # reproducible
    assert not (m[0] == m[1]).any()                                    # differs per layer
    for row, layer_id in zip(m, (1, 14)):
        r = np.random.default_rng(10007 * layer_id).integers(0, bound, size=4, dtype=np.int64)
        assert row.tolist() == [int(x) * 2 + 1 for x in r]
    # no overflow: the largest compressed id times the largest multiplier fits int64
    assert (vocab - 1) * int(m.max()) < 2 ** 63
    assert hash_multipliers((2,), 3, 2 ** 70).tolist() == [[1, 1, 1]]  # bound floors at 1


# --------------------------------------------------------------------------- compressed map

def test_compressed_map_hand_tokenizer(tmp_path):
    tok = hand_tokenizer()
    # the decodes this test relies on
    assert tok.decode([HAND_MAP.index(11)], skip_special_tokens=False) == "\ufffd"
    assert tok.decode([2], skip_special_tokens=False) == SPECIALS[2]
    lookup, size = compressed_token_map(tok)
    assert lookup == HAND_MAP and size == HAND_SIZE
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    assert compressed_token_map(str(path)) == (HAND_MAP, HAND_SIZE)
    assert compressed_token_map(tmp_path) == (HAND_MAP, HAND_SIZE)


def test_compressed_map_project_tokenizer():
    from deepinfer.checkpoint.tokenizer import train_tokenizer

    tok = train_tokenizer(400)
    lookup, size = compressed_token_map(tok)
    assert len(lookup) == 400 and size == max(lookup) + 1 < 400
    seen = -1
    for c in lookup:                       # first-appearance order
        assert c <= seen + 1
        seen = max(seen, c)
    by_text, checked = {}, 0
    for i in range(400):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" not in text and text.strip() and text.lower().strip() != text:
            by_text.setdefault(text.lower().strip(), set()).add(lookup[i])
    for text, ids in by_text.items():       # " The" / "the" / "The" style spellings share an id
        j = tok.token_to_id(_byte_level(text))
        if j is not None:
            assert ids == {lookup[j]}, text
            checked += 1
    assert checked >= 5


# --------------------------------------------------------------------------- hashing

def ref_hash(cfg, lookup, tokens, dead, t):
    """Independent: plain Python ints; primes by a sieve, multipliers straight from numpy."""
    m, heads = cfg.engram_max_ngram_size, cfg.engram_n_heads
    # every (layer, order) restarts below the vocab and skips taken primes: consecutive primes, `heads` at a time
    above = iter(_sieve_primes(cfg.engram_vocab_size, cfg.engram_vocab_size + 4000))
    primes = [[next(above) for _ in range((m - 1) * heads)] for _ in cfg.engram_layer_ids]
    size = max(lookup) + 1
    bound = max(1, ((2 ** 63 - 1) // size) // 2)
    pad = lookup[cfg.engram_pad_id]
    out = []
    for li, layer_id in enumerate(cfg.engram_layer_ids):
        mult = [int(x) * 2 + 1 for x in np.random.default_rng(10007 * layer_id).integers(0, bound, size=m, dtype=np.int64)]
        c, stop = [], False
        for k in range(m):
            stop = stop or t - k < 0 or dead[t - k]
            c.append(pad if stop else lookup[tokens[t - k]])
        row, h, offset = [], c[0] * mult[0], 0
        for n in range(1, m):
            h ^= c[n] * mult[n]
            for j in range(heads):
                p = primes[li][(n - 1) * heads + j]
                row.append(h % p + offset)
                offset += p
        out.append(row)
    return out


@pytest.mark.parametrize("max_ngram,heads", [(4, 3), (3, 2), (2, 1)])
def test_hash_matches_independent_reference(max_ngram, heads):
    cfg = small_cfg(max_ngram, heads)
    hasher = EngramHasher(cfg, HAND_MAP)
    g = torch.Generator().manual_seed(max_ngram)
    tokens = torch.randint(0, len(HAND_MAP), (12,), generator=g)
    dead = torch.zeros(12, dtype=torch.bool)
    dead[[5, 9]] = True
    ids, _ = hasher.hash_ids(tokens, hasher.new_state(), dead)
    assert ids.shape == (12, 2, (max_ngram - 1) * heads) and ids.dtype == torch.int64
    for t in range(12):
        assert ids[t].tolist() == ref_hash(cfg, HAND_MAP, tokens.tolist(), dead.tolist(), t), t


def test_hash_released_sizes_independent_reference():
    # the released layout and a compressed vocab in the tens of thousands: products near int64's edge
    lookup = list(range(99092))
    cfg = small_cfg(engram_layer_ids=(1, 14), engram_vocab_size=16_000_000, engram_n_heads=8,
                    engram_compressed_vocab_size=99092, engram_num_embeddings=(384006168, 384016682),
                    vocab_size=99092)
    hasher = EngramHasher(cfg, lookup)
    tokens = torch.tensor([99091, 99090, 5, 2, 77777, 99091, 1])
    dead = torch.zeros(7, dtype=torch.bool)
    ids, _ = hasher.hash_ids(tokens, hasher.new_state())
    for t in range(7):
        assert ids[t].tolist() == ref_hash(cfg, lookup, tokens.tolist(), dead.tolist(), t)
    assert (ids[..., -1] < torch.tensor([384006168, 384016682])).all()


def test_hash_incremental_equals_one_shot():
    cfg = small_cfg()
    hasher = EngramHasher(cfg, HAND_MAP)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (40,), generator=g)   # includes ids past the tokenizer
    dead = torch.rand(40, generator=g) < 0.15
    full, final = hasher.hash_ids(tokens, hasher.new_state(), dead)
    for cuts in ([*range(41)], [0, 1, 2, 7, 8, 20, 33, 40], [0, 40]):
        state, parts = hasher.new_state(), []
        for s, e in zip(cuts[:-1], cuts[1:]):
            prev, snapshot = state, state.clone()
            part, state = hasher.hash_ids(tokens[s:e], state, dead[s:e])
            assert torch.equal(prev, snapshot)                        # the given state is not modified
            parts.append(part)
        assert torch.equal(torch.cat(parts), full) and torch.equal(state, final)
    # the state is rebuilt from the tail alone
    assert torch.equal(hasher.state_for(tokens[-3:], dead[-3:]), final)
    assert torch.equal(hasher.state_for(tokens, dead), final)


def test_hash_flat_batch_equals_per_sequence():
    cfg = small_cfg()
    hasher = EngramHasher(cfg, HAND_MAP)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, len(HAND_MAP), (n,), generator=g) for n in (5, 1, 9, 2)]
    prefixes = [torch.randint(0, len(HAND_MAP), (n,), generator=g) for n in (0, 7, 2, 1)]
    states = [hasher.state_for(p) for p in prefixes]
    bounds = np.cumsum([0] + [len(s) for s in seqs]).tolist()
    chunks = list(zip(bounds[:-1], bounds[1:]))
    flat, new_states = hasher.hash_ids_flat(torch.cat(seqs), chunks, states)
    for (s, e), seq, prefix, st, new in zip(chunks, seqs, prefixes, states, new_states):
        whole, whole_state = hasher.hash_ids(torch.cat([prefix, seq]), hasher.new_state())
        assert torch.equal(flat[s:e], whole[len(prefix):])
        assert torch.equal(new, whole_state)


def test_hash_start_padding_dead_blocking_and_ranges():
    cfg = small_cfg()
    hasher = EngramHasher(cfg, HAND_MAP)
    pad = HAND_MAP[cfg.engram_pad_id]
    assert hasher.new_state().tolist() == [BLOCKED] * 3
    x, y = 3, 22          # token ids of "The" (compressed 3) and "x" (compressed 13)
    pad_seq = torch.tensor([2, 2, 2, x])
    ref, _ = hasher.hash_ids(pad_seq, hasher.new_state())
    # position 0 of a fresh sequence: look-back past the start uses map[pad] -> same as [pad, pad, pad, x]
    first, _ = hasher.hash_ids(torch.tensor([x]), hasher.new_state())
    assert torch.equal(first[0], ref[3])
    # a DEAD token blocks its slot and every farther one, whatever lies behind it
    dead1 = torch.tensor([0, 1, 0, 0]).bool()
    a, _ = hasher.hash_ids(torch.tensor([y, 14, y, x]), hasher.new_state(), dead1)
    b, _ = hasher.hash_ids(torch.tensor([2, 2, y, x]), hasher.new_state())
    assert torch.equal(a[3], b[3])                                  # x, y, pad, pad
    c, _ = hasher.hash_ids(torch.tensor([5, 14, y, x]), hasher.new_state(), dead1)
    assert torch.equal(a[3], c[3]) and not torch.equal(a[0], c[0])  # nothing behind the DEAD token counts
    d, _ = hasher.hash_ids(torch.tensor([5, 14, y, x]), hasher.new_state())
    h = cfg.engram_n_heads                                           # the 2-gram (x, y) does not reach it
    assert torch.equal(a[3, :, :h], d[3, :, :h]) and not torch.equal(a[3, :, h:], d[3, :, h:])
    # a DEAD token itself hashes as all pad; an id past the tokenizer hashes as DEAD
    dead_row, state = hasher.hash_ids(torch.tensor([x]), hasher.state_for(torch.tensor([y, y, y])), torch.tensor([True]))
    all_pad, _ = hasher.hash_ids(torch.tensor([2, 2, 2, 2]), hasher.new_state())
    assert torch.equal(dead_row[0], all_pad[3]) and state.tolist() == [HAND_MAP[y], HAND_MAP[y], BLOCKED]
    past, _ = hasher.hash_ids(torch.tensor([cfg.vocab_size - 1]), hasher.new_state())
    assert torch.equal(past[0], all_pad[3]) and pad == 2
    # columns lie in their own [offset, offset + prime) range
    g = torch.Generator().manual_seed(2)
    ids, _ = hasher.hash_ids(torch.randint(0, len(HAND_MAP), (200,), generator=g), hasher.new_state())
    primes = torch.tensor(hasher.primes).flatten(1)              # [L, C]
    lo = hasher.offsets
    assert ((ids >= lo) & (ids < lo + primes)).all()
    assert (lo[:, 1:] == (lo + primes)[:, :-1]).all()
    assert (lo[:, -1] + primes[:, -1] == torch.tensor(hasher.num_embeddings)).all()
    assert hasher.n_cols == 9 and ids[:, :, 0].unique().numel() > 5


def test_hasher_rejects_mismatches():
    with pytest.raises(ValueError, match="compressed vocab"):
        EngramHasher(small_cfg(engram_compressed_vocab_size=HAND_SIZE + 1), HAND_MAP)
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        EngramHasher(small_cfg(engram_num_embeddings=(1, 2)), HAND_MAP)
    hasher = EngramHasher.from_tokenizer(small_cfg(), hand_tokenizer())
    assert hasher.pad == 2 and hasher.compressed_vocab_size == HAND_SIZE


# --------------------------------------------------------------------------- module

def _random_engram(cfg, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mod = Engram(cfg, 3, dtype)
    for p in mod.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(dtype))
    return mod


def loop_engram(mod, streams, hash_ids, dead=None):
    """Straightforward per-token, per-stream float64 evaluation."""
    hc, d = mod.hc_mult, mod.hidden_size
    table, w = mod.embed.weight.double(), mod.wkv.weight.double()
    q, k = mod.q_weight.double(), mod.k_weight.double()
    out = torch.empty(streams.shape, dtype=torch.float64)
    for n in range(streams.shape[0]):
        x = torch.cat([table[int(i)] for i in hash_ids[n]])
        kv = w @ x
        value = kv[hc * d:]
        for s in range(hc):
            key, h = kv[s * d:(s + 1) * d], streams[n, s].double()
            dot = float((h * q[s] * k[s] * key).sum())
            dot /= (float(h.square().mean()) + 1e-20) ** 0.5 * (float(key.square().mean()) + 1e-20) ** 0.5 * d ** 0.5
            root = max(abs(dot), 1e-6) ** 0.5
            gate = 1 / (1 + np.exp(-(root if dot >= 0 else -root)))
            if dead is not None and dead[n]:
                gate = 0.0
            out[n, s] = h + gate * value
    return out


def test_engram_forward_matches_loop_float64():
    cfg = small_cfg()
    mod = _random_engram(cfg, torch.float64)
    assert sorted(n for n, _ in mod.named_parameters()) == ["embed.weight", "k_weight", "q_weight", "wkv.weight"]
    assert mod.embed.weight.shape == (EngramHasher(cfg, HAND_MAP).num_embeddings[1], 32)
    assert mod.wkv.weight.shape == (16 * 5, 9 * 32) and mod.q_weight.shape == (4, 16)
    hasher = EngramHasher(cfg, HAND_MAP)
    g = torch.Generator().manual_seed(3)
    n = 7
    ids, _ = hasher.hash_ids(torch.randint(0, len(HAND_MAP), (n,), generator=g), hasher.new_state())
    ids = ids[:, mod.layer_index]
    streams = torch.randn(n, 4, 16, generator=g, dtype=torch.float64)
    out = mod(streams, ids)
    assert out.dtype == torch.float64 and out.shape == streams.shape
    torch.testing.assert_close(out, loop_engram(mod, streams, ids), rtol=1e-12, atol=1e-12)
    assert not torch.equal(out, streams)
    dead = torch.tensor([0, 1, 0, 0, 1, 0, 0]).bool()
    out_dead = mod(streams, ids, dead)
    assert torch.equal(out_dead[dead], streams[dead]) and torch.equal(out_dead[~dead], out[~dead])
    torch.testing.assert_close(out_dead, loop_engram(mod, streams, ids, dead), rtol=1e-12, atol=1e-12)


def test_engram_gate_clamp_at_zero_dot():
    cfg = small_cfg()
    mod = _random_engram(cfg, torch.float64, seed=4)
    mod.q_weight.data[1] = 0.0                        # stream 1: dot == 0 -> gate = sigmoid(+sqrt(1e-6))
    streams = torch.randn(2, 4, 16, dtype=torch.float64)
    ids = torch.zeros(2, 9, dtype=torch.int64)
    out = mod(streams, ids)
    value = (mod.wkv.weight @ mod.embed.weight[0].repeat(9))[64:]
    torch.testing.assert_close(out[:, 1], streams[:, 1] + torch.sigmoid(torch.tensor(1e-3, dtype=torch.float64)) * value)


def test_engram_forward_bf16_close_to_float64():
    cfg = small_cfg()
    mod64 = _random_engram(cfg, torch.float64, seed=5)
    mod16 = Engram(cfg, 3, torch.bfloat16)
    mod16.load_state_dict({k: v.to(torch.bfloat16) for k, v in mod64.state_dict().items()})
    mod64.load_state_dict({k: v.to(torch.bfloat16).double() for k, v in mod64.state_dict().items()})
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, mod64.embed.num_embeddings, (5, 9), generator=g)
    streams = torch.randn(5, 4, 16, generator=g).to(torch.bfloat16)
    out = mod16(streams, ids)
    assert out.dtype == torch.bfloat16
    ref = mod64(streams.double(), ids)
    torch.testing.assert_close(out.double(), ref, rtol=0.05, atol=0.5)


def test_dequantize_engram_rows():
    from deepinfer.kernels.quant import float_to_e8m0

    g = torch.Generator().manual_seed(7)
    q = (torch.randn(3, 64, generator=g) * 8).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0 ** -3, 2.0 ** 4], [1.0, 0.5], [2.0 ** -20, 2.0 ** 10]])
    expect = q.float() * scale.repeat_interleave(32, dim=1)
    for s in (scale, float_to_e8m0(scale), float_to_e8m0(scale).view(torch.float8_e8m0fnu)):
        out = dequantize_engram_rows(q, s, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and torch.equal(out.float(), expect)   # exact in bf16
    assert torch.equal(dequantize_engram_rows(expect, scale, torch.float64), expect.double())


def test_engram_builds_on_meta_with_config_rows():
    cfg = dataclasses.replace(small_cfg(), engram_num_embeddings=())
    with torch.device("meta"):
        mod = Engram(cfg, 1, torch.bfloat16)
    rows = EngramHasher(cfg, HAND_MAP).num_embeddings[0]
    assert mod.layer_index == 0 and mod.embed.weight.shape == (rows, 32) and mod.embed.weight.dtype == torch.bfloat16
