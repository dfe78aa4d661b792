"""Offline DeepSeek-style tokenizer written next to tiny random checkpoints."""

import json
import os
import subprocess
import sys
import time

import pytest

from deepinfer.checkpoint.tokenizer import (
    DEEPSEEK_SPECIAL_TOKENS,
    MIN_VOCAB_SIZE,
    corpus_text,
    train_tokenizer,
    write_tokenizer,
)

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"


def test_special_token_spellings():
    assert DEEPSEEK_SPECIAL_TOKENS == (
        BOS, EOS, PAD, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    )


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 512, 1024, 4096])
def test_exact_size_and_special_ids(vocab_size):
    tok = train_tokenizer(vocab_size)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert tok.get_vocab_size(with_added_tokens=False) == vocab_size
    vocab = tok.get_vocab(with_added_tokens=True)
    assert sorted(vocab.values()) == list(range(vocab_size))
    for i, t in enumerate(DEEPSEEK_SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
        assert tok.id_to_token(i) == t


def test_training_is_fast():
    t0 = time.perf_counter()
    train_tokenizer(4096)
    assert time.perf_counter() - t0 < 2.0


def test_deterministic_in_process_and_across_processes(tmp_path):
    a = train_tokenizer(2048).to_str(pretty=True)
    assert a == train_tokenizer(2048).to_str(pretty=True)
    write_tokenizer(tmp_path / "here", 2048, 512)
    code = "import sys; from deepinfer.checkpoint.tokenizer import write_tokenizer; write_tokenizer(sys.argv[1], 2048, 512)"
    for seed in ("0", "12345"):
        out = tmp_path / f"proc{seed}"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert (out / name).read_bytes() == (tmp_path / "here" / name).read_bytes()
    assert (tmp_path / "here" / "tokenizer.json").read_text(encoding="utf-8") == a


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB_SIZE, 4096])
def test_round_trip(vocab_size):
    tok = train_tokenizer(vocab_size)
    corpus = corpus_text()
    samples = [
        corpus[:2000],
        corpus[len(corpus) // 2: len(corpus) // 2 + 2000],
        "12 + 7 = 19\n",
        'def f(x):\n    return {"a": [1, 2.5, None]}\n',
        "Unseen: zebra quixotic  double  spaces\ttab\r\nCRLF",
        "Unicode: héllo wörld — 你好，世界 🙂🚀 Ελληνικά ∑∫√ 𝔘𝔫𝔦",
        "",
    ]
    for text in samples:
        enc = tok.encode(text, add_special_tokens=False)
        assert tok.decode(enc.ids, skip_special_tokens=False) == text
        # with specials: bos is prepended and skipped on decode
        enc = tok.encode(text)
        assert enc.ids[0] == 0
        assert tok.decode(enc.ids, skip_special_tokens=True) == text
    # chat markers are atomic added tokens, not split into bytes
    ids = tok.encode("<｜User｜>hi<｜Assistant｜><think>x</think>", add_special_tokens=False).ids
    assert ids[0] == 3 and 4 in ids and 5 in ids and 6 in ids


def test_corpus_compresses():
    tok = train_tokenizer(2048)
    text = corpus_text()
    n = len(tok.encode(text, add_special_tokens=False).ids)
    assert n < len(text.encode("utf-8")) / 2.5


def test_too_small_vocab_raises():
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(MIN_VOCAB_SIZE - 1)
    with pytest.raises(ValueError):
        train_tokenizer(256)


def test_autotokenizer_loads_and_chat_template(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_tokenizer(tmp_path, 1024, 4096)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["add_bos_token"] is True

    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(tok) == 1024
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, PAD)
    assert tok.model_max_length == 4096

    ids = tok("12 + 7 = 19")["input_ids"]
    assert ids[0] == 0 and ids.count(0) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "12 + 7 = 19"

    msgs = [{"role": "user", "content": "hi"}]
    s = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert s == f"{BOS}<｜User｜>hi<｜Assistant｜>"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False) == f"{BOS}<｜User｜>hi"

    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ]
    s = tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    assert s == f"{BOS}Be brief.<｜User｜>2+2?<｜Assistant｜>4{EOS}<｜User｜>3+3?<｜Assistant｜>"

    # tokenized chat: exactly one bos (template's), markers are single tokens
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids[0] == 0 and ids.count(0) == 1
    assert ids[1] == 3 and ids[-1] == 4
