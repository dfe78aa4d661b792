"""Every DEEPINFER_* environment variable the engine reads, in one place (README lists them).

DEEPINFER_HF_MODEL_DIR is read by checkpoint/hub.py."""

from __future__ import annotations

import os

from .errors import DeepInferError

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip().lower()
    if v not in _TRUE | _FALSE:
        raise DeepInferError(f"{name}={raw!r} is not a boolean; use 1 or 0")
    return v in _TRUE


def env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise DeepInferError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise DeepInferError(f"{name}={value} must be >= {minimum}")
    return value


def async_scheduling_default() -> bool:
    """DEEPINFER_ASYNC_SCHEDULING (default 1): plan step N+1 while the device runs step N."""
    return env_flag("DEEPINFER_ASYNC_SCHEDULING", True)


def accelerator() -> str:
    """DEEPINFER_ACCELERATOR (also build.sh's wheel choice): the device used when none is given.
    nvidia | cuda | cuda:N -> that GPU, cpu -> cpu, auto -> cuda when a GPU is visible; unset -> cpu."""
    raw = os.environ.get("DEEPINFER_ACCELERATOR", "cpu").strip().lower() or "cpu"
    if raw == "auto":
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    if raw == "nvidia":
        return "cuda"
    if raw != "cpu" and raw != "cuda" and not (raw.startswith("cuda:") and raw[5:].isdigit()):
        raise DeepInferError(f"DEEPINFER_ACCELERATOR={raw!r}: use cpu, nvidia, cuda, cuda:N or auto")
    return raw


def check_device(device) -> str:
    """A device string LLM can use, or one error line (unknown name, no CUDA build / GPU, index out of range)."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise DeepInferError(f"device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeepInferError(f"device={device!r}: no CUDA GPU is visible to this torch build "
                                 f"(torch {torch.__version__}); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeepInferError(f"device={device!r}: only {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type != "cpu":
        raise DeepInferError(f"device={device!r}: deepinfer runs on cpu or cuda")
    return str(dev)


def kernel_backend(requested: str | None = None) -> str:
    """The kernel backend set an engine is built with (kernels/table.py): `requested` (LLM's kernel_backend)
    else DEEPINFER_KERNEL_BACKEND else `reference`; DEEPINFER_BATCH_INVARIANT=1 selects `invariant` and
    cannot be combined with another choice."""
    from deepinfer.kernels.table import BACKEND_SETS
    invariant = env_flag("DEEPINFER_BATCH_INVARIANT", False)
    raw = os.environ.get("DEEPINFER_KERNEL_BACKEND", "").strip()
    name = requested if requested is not None else (raw or None)
    source = "kernel_backend" if requested is not None else "DEEPINFER_KERNEL_BACKEND"
    if name is not None and name not in BACKEND_SETS:
        raise DeepInferError(f"{source}={name!r} is not a kernel backend; use one of {list(BACKEND_SETS)}")
    if invariant:
        if name not in (None, "invariant"):
            raise DeepInferError(f"DEEPINFER_BATCH_INVARIANT=1 selects the 'invariant' kernels but {source}="
                                 f"{name!r}; unset one of them")
        return "invariant"
    return name or "reference"


def check_environment() -> None:
    """Read every DEEPINFER_* setting once, before any work, so a bad value is one error line up front."""
    kernel_backend()
    async_scheduling_default()
    yoco_prefill()
    yoco_prefill_min_tokens()


def yoco_prefill() -> bool:
    """DEEPINFER_YOCO_PREFILL (default 1): V4.1 prefill pieces that need only their last logits run with YOCO
    truncation (exact; docs/model-v41.md). 0 runs every layer on every row."""
    return env_flag("DEEPINFER_YOCO_PREFILL", True)


def yoco_prefill_min_tokens() -> int:
    """DEEPINFER_YOCO_PREFILL_MIN_TOKENS (default 2): pieces shorter than this run untruncated."""
    return env_int("DEEPINFER_YOCO_PREFILL_MIN_TOKENS", 2, 1)


def configure_logging() -> None:
    """DEEPINFER_CONFIGURE_LOGGING (default 1): give the `deepinfer` logger an INFO handler on stderr (as vLLM
    does), so start-up lines such as the state-pool sizes are seen; 0 leaves logging to the application."""
    import logging
    import sys
    logger = logging.getLogger("deepinfer")
    try:
        wanted = env_flag("DEEPINFER_CONFIGURE_LOGGING", True)
    except DeepInferError as e:          # at import: say it, keep the default, never a traceback
        print(f"deepinfer: {e}; configuring logging as by default", file=sys.stderr)
        wanted = True
    if not wanted or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s deepinfer: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
