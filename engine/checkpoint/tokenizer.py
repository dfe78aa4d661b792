"""Offline byte-level BPE tokenizer for tiny random DeepSeek checkpoints.

No model hub is reachable, so the tokenizer is trained on a small corpus that ships
with the package (``data/corpus.txt``). Training is deterministic: the same
``vocab_size`` gives byte-identical ``tokenizer.json`` in any process.
"""

from __future__ import annotations

import json
import os
import secrets
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"

# Id order is the id: bos=0, eos=1, pad=2, then the chat / reasoning markers.
DEEPSEEK_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, "<think>", "</think>",
)
# As in DeepSeek-V3, only bos/eos/pad are "special" (dropped by skip_special_tokens);
# the chat and think markers are ordinary added tokens that survive decoding.
_CONTROL_TOKENS = DEEPSEEK_SPECIAL_TOKENS[:3]
# 256 byte-level base tokens + the specials + at least a few merges.
MIN_VOCAB_SIZE = 256 + len(DEEPSEEK_SPECIAL_TOKENS) + 8

# DeepSeek-style chat: bos, system text (all system messages, up front), then turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}{% endfor %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'user' %}" + USER_TOKEN + "{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}" + ASSISTANT_TOKEN + "{{ m['content'] }}" + EOS_TOKEN +
    "{% else %}{{ raise_exception('unsupported role: ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT_TOKEN + "{% endif %}"
)


def _filler_token(i: int) -> str:
    # Same spelling as DeepSeek-V3's reserved slots.
    return f"<｜place▁holder▁no▁{i}｜>"


def corpus_text() -> str:
    return resources.files("deepinfer.checkpoint").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with exactly ``vocab_size`` entries (specials at ids 0..6)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs 256 byte tokens + "
            f"{len(DEEPSEEK_SPECIAL_TOKENS)} special tokens + some merges (minimum {MIN_VOCAB_SIZE})"
        )
    tok = Tokenizer(models.BPE())
    # DeepSeek-V3 splits numbers into groups of at most 3 digits before the byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(DEEPSEEK_SPECIAL_TOKENS),  # the trainer puts these first, at ids 0..k-1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
    )
    # The trainer's merge order is fixed (count, then pair ids), so this is deterministic.
    tok.train_from_iterator(corpus_text().splitlines(keepends=True), trainer=trainer)

    # Padding: a small corpus runs out of merges (min_frequency=2) below large targets. The
    # missing ids are filled with reserved tokens <｜place▁holder▁no▁N｜> (DeepSeek-V3's name
    # for its unused slots) appended to the BPE model's vocab at the next ids. No merge ever
    # produces them, so they never appear when encoding, but len(tokenizer) == vocab_size ==
    # the model's vocab_size, and ids the (random) model samples there still decode.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=False)
    if missing > 0:
        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        base = len(vocab)
        vocab.update({_filler_token(i): base + i for i in range(missing)})
        tok = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))

    # Register the specials as added tokens (they already have ids 0..k-1, so no new ids).
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in _CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in DEEPSEEK_SPECIAL_TOKENS[3:]])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} entries, wanted {vocab_size}")

    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos)]
    )
    return tok


def _atomic_write(path: Path, text: str) -> None:
    """Write `text` to a temporary sibling, then rename it over `path`. The file gets the mode of any
    normal write (0o666 & ~umask; tempfile.mkstemp would make it 0o600, unreadable to other users)."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_tokenizer(out_dir: str | os.PathLike, vocab_size: int, model_max_length: int,
                    tokenizer: Tokenizer | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``: ``tokenizer`` when given
    (it must have ``vocab_size`` entries), else the one ``train_tokenizer(vocab_size)`` gives."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size) if tokenizer is None else tokenizer
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} entries but the model's "
                         f"vocab_size is {vocab_size}")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "chat_template": CHAT_TEMPLATE,
    }
    _atomic_write(out / "tokenizer.json", tok.to_str(pretty=True))
    _atomic_write(out / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def read_tokenizer(ckpt_dir: Path, needed_for: str) -> Tokenizer:
    """<ckpt_dir>/tokenizer.json as a Tokenizer; a missing or unreadable file is one CheckpointError line saying
    what it is `needed_for`."""
    from ..errors import CheckpointError
    tok_file = Path(ckpt_dir) / "tokenizer.json"
    if not tok_file.is_file():
        raise CheckpointError(f"{ckpt_dir} has no tokenizer.json, which {needed_for}; copy the checkpoint's "
                              f"tokenizer.json there")
    try:
        return Tokenizer.from_file(str(tok_file))
    except Exception as err:   # noqa: BLE001  tokenizers raises a bare Exception for malformed files
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(f"{tok_file} could not be read as a tokenizer ({why}); re-download it") from None
