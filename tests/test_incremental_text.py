"""Stop strings on incrementally decoded text (engine/output_processor.Detokenizer, prefix_stable): with the
embedded byte-level tokenizer, every token stream, cut anywhere, decodes to the same text as the whole output, so
the stop decisions (finish reason, where the stop string starts, which one, tokens kept) equal those of decoding
the whole output per token, on streams that split multi-byte characters and hold invalid bytes."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.output_processor import Detokenizer, OutputProcessor, byte_level
from deepinfer.sampling import SamplingParams
from deepinfer.scheduler import Request

TEXTS = ["The capital of France is Paris.\n\nAnswer: 42", "naïve café — 東京タワー 🙂🚀 ok", "a\ufffdb 𝔘𝔫𝔦 end"]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(str(embedded_tiny_dir("deepseek_v41") / "tokenizer.json"))


def _stream(tok, rng: random.Random) -> list[int]:
    """A generated-looking stream: encoded text, with random tokens (byte tokens among them) spliced in."""
    ids = tok.encode(rng.choice(TEXTS) + rng.choice(TEXTS)).ids
    for _ in range(rng.randrange(0, 6)):
        ids.insert(rng.randrange(len(ids) + 1), rng.randrange(tok.get_vocab_size()))
    return ids


def _commit_all(proc: OutputProcessor, ids: list[int], stop: list[str], min_tokens: int, chunks: list[int]):
    r = Request("r", [1], SamplingParams(max_tokens=len(ids) + 1, stop=stop, min_tokens=min_tokens), seed=0)
    at = 0
    for n in chunks:                          # commits of 1..3 tokens, as verify rows make
        if r.finish_reason is not None or at >= len(ids):
            break
        kept = proc.commit(r, ids[at:at + n], [None] * len(ids[at:at + n]), 0.0)
        at += kept
    return r.finish_reason, r.stop_at, r.stop_reason, list(r.output_ids), proc.text(r)


def test_the_decoder_is_byte_level(tok):
    assert byte_level(tok)


def test_incremental_stop_strings_equal_whole_output_decoding(tok):
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)      # noqa: E731
    rng, stops_found = random.Random(0), 0
    for case in range(300):
        ids = _stream(tok, rng)
        text = decode(ids)
        a = rng.randrange(len(text))
        stop = [text[a:a + rng.randrange(1, 6)], rng.choice(["\n\n", "Answer:", "🚀", "\ufffd", "zz"])]
        min_tokens = rng.choice([0, 0, 3])
        chunks = [rng.randrange(1, 4) for _ in range(len(ids))]
        whole = _commit_all(OutputProcessor(decode, None, 10_000), ids, stop, min_tokens, chunks)
        incremental = OutputProcessor(Detokenizer(decode, prefix_stable=True), None, 10_000)
        assert incremental.prefix_stable
        assert _commit_all(incremental, ids, stop, min_tokens, chunks) == whole, (case, ids, stop)
        stops_found += whole[0] == "stop"
    assert stops_found > 150                  # the comparison covers matches, not only misses


def test_only_a_prefix_stable_decoder_decodes_incrementally(tok):
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return tok.decode(ids)
    ids = tok.encode("one two three four five six seven eight nine ten").ids
    for stable in (False, True):
        calls.clear()
        proc = OutputProcessor(Detokenizer(decode, prefix_stable=stable), None, 10_000)
        _commit_all(proc, ids, ["never"], 0, [1] * len(ids))
        longest = max(calls[:-1])                 # the last call: text() decodes the whole output once
        assert longest == (len(ids) if not stable else 1), calls
