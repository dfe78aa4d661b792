"""Every DEEPINFER_* environment variable, in one table with one rule each (README's table lists the same ones; a
test keeps them equal). Every entry point (LLM, load_model, the three CLIs) calls `check_environment()` before any
work, so a bad value, or a DEEPINFER_* name that is not one of these, is the same one error line wherever it is
read. An empty value means unset.

Kinds: flag = 1/0 (also true/false, yes/no, on/off, any case); int = a decimal integer >= a minimum; choice = one
of a list; path = an existing directory (what it must hold is checked where it is used); build = a free string read
by build.sh only."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import DeepInferError, did_you_mean

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
PREFIX = "DEEPINFER_"


@dataclass(frozen=True)
class Var:
    kind: str                    # flag | int | choice | path | build
    default: object = None
    minimum: int = 0             # int
    maximum: int | None = None   # int (None: unbounded)
    choices: tuple = ()          # choice (cuda:N is also taken by DEEPINFER_ACCELERATOR)
    doc: str = ""


VARIABLES = {
    "DEEPINFER_ACCELERATOR": Var("choice", "cpu", choices=("cpu", "nvidia", "cuda", "auto"),
                                 doc="default device (nvidia/cuda/cuda:N -> that GPU, auto -> a GPU when visible); "
                                     "build.sh's wheel choice"),
    "DEEPINFER_KERNEL_BACKEND": Var("choice", None, choices=("reference", "invariant", "triton", "triton_invariant"),
                                    doc="kernel backend set when LLM(kernel_backend=) is not given"),
    "DEEPINFER_BATCH_INVARIANT": Var("flag", False, doc="1 = the invariant kernel backend"),
    "DEEPINFER_ASYNC_SCHEDULING": Var("flag", True, doc="plan step N+1 while the device runs step N"),
    "DEEPINFER_PDL": Var("flag", False, doc="1 = programmatic dependent launch of the Triton kernels on sm_90+ "
                                            "(kernels/pdl.py; off until measured on a GPU)"),
    "DEEPINFER_YOCO_PREFILL": Var("flag", True, doc="V4.1 YOCO-truncated prefill of last-logit pieces"),
    "DEEPINFER_YOCO_PREFILL_MIN_TOKENS": Var("int", 2, minimum=1, doc="shorter pieces run untruncated"),
    "DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": Var("choice", "exact", choices=("exact", "compact"),
                                                  doc="exact: the shrinking suffix (outputs unchanged); compact: the "
                                                      "last KEEP_TOKENS rows from the last KV source on "
                                                      "(DeepInfer's approximation; docs/prefix-cache.md)"),
    "DEEPINFER_YOCO_PREFILL_KEEP_TOKENS": Var("int", 140, minimum=1, doc="rows compact truncation keeps"),
    "DEEPINFER_USE_NEXTN_DECODE": Var("int", None, minimum=0, maximum=5, doc="speculative decoding with up to N "
                                      "drafts a step (0 = off; 5: the drafters' largest block) when "
                                      "LLM(speculative=) is not given"),
    "DEEPINFER_ENABLE_MTP_VARLEN": Var("flag", False, doc="1 = confidence-scheduled (variable-length) verification"),
    "DEEPINFER_CONFIGURE_LOGGING": Var("flag", True, doc="INFO handler for the deepinfer logger on stderr"),
    "DEEPINFER_HF_MODEL_DIR": Var("path", None, doc="local checkpoint directory used instead of a hub download"),
    "DEEPINFER_V41_REFERENCE": Var("path", None, doc="tests: transformers main's deepseek_v41 package directory"),
    "DEEPINFER_TORCH_SPEC": Var("build", doc="build.sh: torch requirement"),
    "DEEPINFER_TORCH_INDEX_URL": Var("build", doc="build.sh: extra torch wheel index"),
    "DEEPINFER_NO_TEST_DEPS": Var("flag", False, doc="build.sh: 1 skips the test dependencies"),
}


def _raw(name: str) -> str | None:
    raw = os.environ.get(name)
    return None if raw is None or not raw.strip() else raw.strip()


def read(name: str):
    """The value of DEEPINFER_<...> `name` under its rule (its default when unset or empty)."""
    var = VARIABLES[name]
    raw = _raw(name)
    if raw is None:
        return var.default
    if var.kind == "flag":
        v = raw.lower()
        if v not in _TRUE + _FALSE:
            raise DeepInferError(f"{name}={raw!r} is not a flag; use 1 or 0")
        return v in _TRUE
    if var.kind == "int":
        span = f"in {var.minimum}..{var.maximum}" if var.maximum is not None else f">= {var.minimum}"
        if not (raw.isascii() and raw.isdigit()):       # ASCII digits only: no sign, '²', '1_000' (int() takes them)
            raise DeepInferError(f"{name}={raw!r} is not an integer; use an integer {span}")
        value = int(raw)
        if value < var.minimum or (var.maximum is not None and value > var.maximum):
            raise DeepInferError(f"{name}={value} must be {span}")
        return value
    if var.kind == "choice":
        v = raw.lower() if name == "DEEPINFER_ACCELERATOR" else raw
        gpu_index = name == "DEEPINFER_ACCELERATOR" and v.startswith("cuda:") and v[5:].isdigit()
        if v not in var.choices and not gpu_index:
            extra = ", cuda:N" if name == "DEEPINFER_ACCELERATOR" else ""
            raise DeepInferError(f"{name}={raw!r}: use one of {', '.join(var.choices)}{extra}")
        return v
    if var.kind == "path" and not os.path.isdir(os.path.expanduser(raw)):
        raise DeepInferError(f"{name}={raw!r} is not a directory; point it at one, or unset it")
    return raw


# switches that choose nothing about how an engine computes (the device is a row field of its own)
NOT_ENGINE = ("DEEPINFER_ACCELERATOR", "DEEPINFER_CONFIGURE_LOGGING", "DEEPINFER_NO_TEST_DEPS")


def settings() -> dict:
    """The DEEPINFER_* engine switches this process sets away from their defaults, by name (their rule's values),
    for rows: a figure taken under one (compact YOCO truncation, async scheduling off, ...) says so. Paths, build
    and logging switches are left out (no machine paths in rows; they do not change how a built engine computes)."""
    return {name: value for name, var in VARIABLES.items()
            if var.kind not in ("path", "build") and name not in NOT_ENGINE and _raw(name) is not None
            and (value := read(name)) != var.default}


def check_environment() -> None:
    """Read every DEEPINFER_* variable under its rule, before any work: a bad value or an unknown DEEPINFER_* name
    (a typo would otherwise be ignored) is one error line."""
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in VARIABLES:
            hint = did_you_mean(name, VARIABLES)
            raise DeepInferError(f"{name} is not a deepinfer setting" + (f" ({hint})" if hint else "")
                                 + "; unset it (the known ones are listed in the README)")
    for name in VARIABLES:
        read(name)
    kernel_backend()                       # the name only: the device is the engine's to check
    from deepinfer.kernels.pdl import set_enabled
    set_enabled(read("DEEPINFER_PDL"))     # a launch option, set before any kernel runs


def accelerator() -> str:
    """DEEPINFER_ACCELERATOR as a device name: nvidia -> cuda, auto -> cuda when a GPU is visible, else as given."""
    v = read("DEEPINFER_ACCELERATOR")
    if v == "auto":
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if v == "nvidia" else v


def async_scheduling_default() -> bool:
    return read("DEEPINFER_ASYNC_SCHEDULING")


def yoco_prefill() -> bool:
    """V4.1 prefill pieces that need only their last logits run with YOCO truncation (exact; docs/model-v41.md)."""
    return read("DEEPINFER_YOCO_PREFILL")


def yoco_prefill_min_tokens() -> int:
    return read("DEEPINFER_YOCO_PREFILL_MIN_TOKENS")


def yoco_keep_tokens() -> int | None:
    """Rows compact YOCO truncation keeps, or None in the exact mode (the default)."""
    return read("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS") if read("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE") == "compact" \
        else None


def hf_model_dir() -> str | None:
    return read("DEEPINFER_HF_MODEL_DIR")


def default_backend(device: str) -> str:
    """`triton` on a CUDA device of compute capability >= 8.9 (FP8 MMA) where Triton imports, else `reference`."""
    if not str(device).startswith("cuda"):
        return "reference"
    from deepinfer.kernels.gpu import triton_available
    import torch
    if not triton_available() or not torch.cuda.is_available():
        return "reference"
    index = torch.device(device).index
    return "triton" if torch.cuda.get_device_capability(index or 0) >= (8, 9) else "reference"


def kernel_backend(requested: str | None = None, device: str | None = None) -> str:
    """The kernel backend set an engine on `device` is built with (kernels/registry.py): `requested` (LLM's
    kernel_backend) else DEEPINFER_KERNEL_BACKEND else the device's default (`default_backend`);
    DEEPINFER_BATCH_INVARIANT=1 selects the batch-invariant partner of that default (`invariant` on CPU,
    `triton_invariant` on CUDA) and cannot be combined with a non-invariant choice. The Triton sets need CUDA
    (checked when `device` is given; device None checks the name only and picks as for a CPU)."""
    from deepinfer.kernels.registry import BACKEND_SETS, INVARIANT_OF
    invariant = read("DEEPINFER_BATCH_INVARIANT")
    name = requested if requested is not None else read("DEEPINFER_KERNEL_BACKEND")
    source = "kernel_backend" if requested is not None else "DEEPINFER_KERNEL_BACKEND"
    if name is not None and name not in BACKEND_SETS:
        raise DeepInferError(f"{source}={name!r} is not a kernel backend; use one of {list(BACKEND_SETS)}")
    if name is not None and name.startswith("triton") and device is not None and default_backend(device) != "triton":
        raise DeepInferError(f"{source}={name!r} needs a CUDA device with compute capability >= 8.9 and Triton; "
                             f"on {device} use 'reference' or 'invariant'")
    if invariant:
        if name is not None and INVARIANT_OF[name] != name:
            raise DeepInferError(f"DEEPINFER_BATCH_INVARIANT=1 selects batch-invariant kernels but {source}="
                                 f"{name!r}; unset one of them")
        return name or INVARIANT_OF[default_backend(device or "cpu")]
    return name or default_backend(device or "cpu")


def configure_logging() -> None:
    """DEEPINFER_CONFIGURE_LOGGING (default 1): give the `deepinfer` logger an INFO handler on stderr (as vLLM
    does), so start-up lines such as the state-pool sizes are seen; 0 leaves logging to the application. At import
    a bad value is not raised (nothing may fail at import); every entry point refuses it in check_environment."""
    import logging
    import sys
    logger = logging.getLogger("deepinfer")
    try:
        wanted = read("DEEPINFER_CONFIGURE_LOGGING")
    except DeepInferError:
        wanted = False
    if not wanted or logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s deepinfer: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
