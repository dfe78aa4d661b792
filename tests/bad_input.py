"""The error contract (docs/errors.md) as test helpers: a refused input exits 2 (CLI) or raises the API's error type,
with one line that says what is wrong, and writes nothing.

    refuse_cli(cli, ["run", "--prompt", ""], watch=[tmp_path], match="prompt 0 is empty")
    refuse_api(lambda: LLM(model=3), DeepInferError, match="model=3")

`watch`: directories whose file lists (recursively, with sizes) must be the same after the refusal."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from deepinfer.cli import run_cli


def snapshot(dirs) -> dict:
    """{path: size} of every file and directory under `dirs` (missing dirs count as empty)."""
    out = {}
    for d in dirs:
        d = Path(d)
        if not d.exists():
            continue
        for root, subdirs, files in os.walk(d):
            out[root] = -1
            for f in files:
                p = os.path.join(root, f)
                try:
                    out[p] = os.path.getsize(p)
                except OSError:
                    out[p] = -2
    return out


def one_line(message: str) -> str:
    """The message, asserted to be a single non-empty line without a traceback."""
    text = message.strip()
    assert text, "no message at all"
    assert "Traceback" not in text, text
    assert len(text.splitlines()) == 1, f"not one line:\n{text}"
    return text


def refuse_cli(cli, args: list[str], match: str, watch=(), env: dict | None = None, input: str | None = None) -> str:
    """Run a click group through deepinfer's entry wrapper; assert exit status 2, one `error:` line on stderr
    matching `match` (a regex), and nothing written under `watch`. Returns the line."""
    before = snapshot(watch)
    runner = CliRunner()

    def entry():
        run_cli(cli)
    with runner.isolation(input=input, env=env) as (out, err, *_):
        import sys
        old_argv = sys.argv
        sys.argv = ["prog", *args]
        code = 0
        try:
            entry()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        finally:
            sys.argv = old_argv
        stderr = err.getvalue().decode()
    line = one_line(stderr)
    assert code == 2, f"exit {code}, stderr: {stderr}"
    assert line.startswith("error: "), line
    assert re.search(match, line), f"{match!r} not in {line!r}"
    assert snapshot(watch) == before, "something was written"
    return line


def refuse_api(call, error_type, match: str, watch=()) -> str:
    """Assert `call()` raises `error_type` with a one-line message matching `match`, writing nothing."""
    before = snapshot(watch)
    with pytest.raises(error_type) as info:
        call()
    line = one_line(str(info.value))
    assert re.search(match, line), f"{match!r} not in {line!r}"
    assert snapshot(watch) == before, "something was written"
    return line
