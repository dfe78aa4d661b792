"""The one rule for text that enters the engine (prompts, chat messages, stop strings, structured-output schemas,
files and arguments the CLIs read): it must be valid Unicode that encodes to UTF-8, checked where it enters so that
the tokenizer, xgrammar or a file write never meet it.

Two ways text is invalid: a lone surrogate (U+D800..U+DFFF; a Python str can hold one, UTF-8 cannot), and, on the
command line (which Python decodes with `surrogateescape`), a byte that is not UTF-8, which Python keeps as
U+DC80..U+DCFF. There the message names the byte, since that is what the user typed; a file the user named is
decoded by read_text_file, which names the byte and its offset."""

from __future__ import annotations

from .errors import DeepInferError


def check_text(what: str, text: str, from_bytes: bool = False) -> str:
    """`text` unchanged when it encodes to UTF-8; else one error line naming `what`, the character position and
    the offending code point, or, for text Python decoded from bytes with surrogateescape (`from_bytes`: the
    command line), the byte it stands for."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        if from_bytes and 0xDC80 <= code <= 0xDCFF:          # surrogateescape's stand-in for a raw byte
            raise DeepInferError(f"{what} is not valid UTF-8: byte 0x{code - 0xDC00:02x} at character {err.start}; "
                                 f"give UTF-8 text") from None
        raise DeepInferError(f"{what} is not valid Unicode text: a lone surrogate U+{code:04X} at character "
                             f"{err.start}; remove it or give the full surrogate pair's character") from None
    return text


def read_text_file(what: str, path) -> str:
    """A text file the user named, decoded as UTF-8: a file that is not UTF-8 is one error line naming the byte
    and where it is (OSError stays an OSError: the CLIs' error path names the path)."""
    from pathlib import Path
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DeepInferError(f"{what} {path} is not UTF-8 text: byte 0x{data[err.start]:02x} at byte {err.start} "
                             f"(line {line}); save it as UTF-8") from None
