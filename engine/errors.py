"""The one exception type users see: a single line saying what is wrong and what to do."""

import difflib


class DeepInferError(Exception):
    """A user-facing error. The CLI prints `str(err)` alone, never a traceback."""


class ConfigError(DeepInferError, ValueError):
    """config.json (or a config dict) is malformed or inconsistent."""


class CheckpointError(DeepInferError):
    """A checkpoint file or tensor is missing, corrupt or does not match the config."""


class ModelNotFoundError(DeepInferError):
    """A model id could not be resolved to a local directory."""


def did_you_mean(words, choices, n: int = 1, quote: bool = False) -> str:
    """The hint of an unknown-name error: 'did you mean X?' naming the choices nearest to `words` (one name or
    several; up to n per name, quoted with quote=True), or '' when none is near."""
    words = [words] if isinstance(words, str) else list(words)
    near = [m for w in words for m in difflib.get_close_matches(w, list(choices), n=n)]
    return f"did you mean {', '.join(repr(m) if quote else m for m in near)}?" if near else ""
