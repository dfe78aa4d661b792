"""Resolve `model=` to a local checkpoint directory: a local path, DEEPINFER_HF_MODEL_DIR, or the hub."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ModelNotFoundError

DEFAULT_MODEL_ID = "deepseek-ai/DeepSeek-V4.1-Flash-1017"
MODEL_DIR_ENV = "DEEPINFER_HF_MODEL_DIR"
ALLOW_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


def locate_model(model: str | os.PathLike | None = None) -> Path | str:
    """Where `model` will come from, without downloading: a checked local directory (an existing `model`, else
    DEEPINFER_HF_MODEL_DIR), or the hub id to fetch (default DEFAULT_MODEL_ID). Every entry point calls this
    before any work, so a missing directory is one line up front."""
    from ..env import hf_model_dir
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ModelNotFoundError(f"model={model!r} is a {type(model).__name__}; give a checkpoint directory or a "
                                 f"hub id (org/name)")
    if model is not None and Path(model).expanduser().is_dir():
        return _checked(Path(model).expanduser(), "model")
    env = hf_model_dir()
    if env:
        return _checked(Path(env).expanduser(), MODEL_DIR_ENV)
    repo_id = str(model or DEFAULT_MODEL_ID)
    if repo_id.startswith((".", "/", "~")) or repo_id.count("/") != 1:
        raise ModelNotFoundError(f"model {repo_id!r} is neither a local directory nor a hub id (org/name); LLM and "
                                 f"the CLIs also take 'tiny' (the embedded tiny model) and random:ARCH:PRESET:LAYERS")
    return repo_id


def resolve_model_dir(model: str | os.PathLike | None = None) -> Path:
    """An existing local directory wins; else DEEPINFER_HF_MODEL_DIR; else the hub id (default
    DEFAULT_MODEL_ID) fetched with huggingface_hub into its cache. Failures: one clear line."""
    where = locate_model(model)
    if isinstance(where, Path):
        return where
    repo_id = where
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    try:
        return Path(snapshot_download(repo_id=repo_id, allow_patterns=ALLOW_PATTERNS))
    except GatedRepoError:
        reason = "the repository is gated: accept its terms and log in (hf auth login)"
    except RepositoryNotFoundError:
        reason = "no such repository (or it is private)"
    except Exception as err:  # offline, DNS, proxy, timeouts: huggingface_hub raises many kinds
        if _offline():
            reason = "HF_HUB_OFFLINE is set and it is not in the local hub cache"
        else:
            reason = f"the hub is unreachable ({type(err).__name__})"
    raise ModelNotFoundError(f"cannot fetch {repo_id!r}: {reason}; download it where the hub is reachable and "
                             f"set {MODEL_DIR_ENV} (or --model) to the local directory")


def _offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return True
    try:
        from huggingface_hub import constants
        return bool(constants.HF_HUB_OFFLINE)
    except Exception:  # pragma: no cover - very old huggingface_hub
        return False


def _checked(path: Path, source: str) -> Path:
    if not path.is_dir():
        raise ModelNotFoundError(f"{path} (from {source}) does not exist or is not a directory: point it at a "
                                 f"checkpoint directory (config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        try:
            what = "is empty" if not any(path.iterdir()) else "has no config.json"
        except OSError:
            what = "has no readable config.json"
        raise ModelNotFoundError(f"{path} (from {source}) {what}: point it at a checkpoint directory "
                                 f"(config.json + *.safetensors)")
    return path
