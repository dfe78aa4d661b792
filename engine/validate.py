"""The checks every entry point shares: `LLM`, `load_model`, `deepinfer run|generate|make-checkpoint`, `deepinfer-bench`
(sweep files included) and `deepinfer-eval` (suite files included). One function per kind of input; each returns
the normalized value or raises one DeepInferError line that says what is wrong and what to do (docs/errors.md is
the contract). Environment variables have their own reader, env.py."""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import CONFIG_CLASSES
from .errors import ConfigError, DeepInferError
from .models.common.layers import PROJECTION_STORAGE
from .text import check_text

# dtype names every entry point takes, in the order messages and --help list them
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}
DTYPE_NAMES = tuple(DTYPES)
ARCHS = tuple(CONFIG_CLASSES)         # model families, the default first
PRESETS = ("tiny", "flash")
EXPERT_STORAGE = ("dense", "fp4")
EMBEDDED = "tiny"                     # the embedded tiny checkpoint (built once into the user cache)
MODEL_FORMS = (f"a checkpoint directory, a hub id (org/name), '{EMBEDDED}' (the embedded tiny model) or "
               f"random:ARCH:PRESET:LAYERS[:skew=S] (ARCH {'|'.join(ARCHS)}, PRESET {'|'.join(PRESETS)})")
MAX_ROUTER_SKEW = 4.0
RANDOM_FORM = ("random:ARCH:PRESET:LAYERS[:skew=S] with ARCH in " + "|".join(ARCHS) + ", PRESET in " + "|".join(PRESETS)
               + ", LAYERS an integer >= 1 and S the routers' hot-expert skew in [0, 4] (default 0: balanced), "
                 f"e.g. random:{ARCHS[0]}:flash:4 or random:{ARCHS[0]}:flash:4:skew=0.8")


@dataclass(frozen=True)
class RandomSpec:
    """A parsed random:ARCH:PRESET:LAYERS[:skew=S] model name."""
    arch: str
    preset: str
    layers: int
    skew: float = 0.0


def parse_random_spec(spec: str) -> RandomSpec:
    """random:ARCH:PRESET:LAYERS[:skew=S] -> RandomSpec; anything else in that form is one line."""
    parts = spec.split(":")
    skew = 0.0
    if len(parts) == 5 and parts[4].startswith("skew="):
        try:
            skew = float(parts[4][len("skew="):])
        except ValueError:
            skew = math.nan
        parts = parts[:4]
    if (len(parts) != 4 or parts[0] != "random" or parts[1] not in ARCHS or parts[2] not in PRESETS
            or not parts[3].isdigit() or int(parts[3]) < 1 or not (0 <= skew <= MAX_ROUTER_SKEW)):
        raise DeepInferError(f"model={spec!r}: a random model is {RANDOM_FORM}")
    return RandomSpec(parts[1], parts[2], int(parts[3]), skew)


def check_router_skew(skew) -> float:
    """A random model's hot-expert skew (make-checkpoint --router-skew, random:...:skew=S): a number in [0, 4]."""
    if isinstance(skew, bool) or not isinstance(skew, numbers.Real) or not (0 <= skew <= MAX_ROUTER_SKEW):
        raise DeepInferError(f"router skew {skew!r} must be a number in [0, {MAX_ROUTER_SKEW:g}] (0: balanced "
                             f"routing, 0.8: a strong hot-expert skew; docs/bench.md has the load curve)")
    return float(skew)


def refuse_unsupported(call: str, given: dict, known: str) -> None:
    """Keyword arguments a call does not have (vLLM's lora_request, chat_template_kwargs, ...): one line, not a
    TypeError."""
    if given:
        raise DeepInferError(f"{call}() got unsupported arguments {sorted(given)}; it takes {known}")


def check_flag(name: str, value, none_ok: bool = False) -> None:
    """A True/False argument: anything else (a string "no" would be truthy) is one line."""
    if not isinstance(value, bool) and not (none_ok and value is None):
        raise DeepInferError(f"{name}={value!r} must be True or False" + (" (or None)" if none_ok else ""))


def check_expert_storage(expert_storage, arch: str) -> str:
    """'dense' for every model; 'fp4' (experts kept packed as stored) where the family's config allows it."""
    allowed = CONFIG_CLASSES[arch].EXPERT_STORAGES
    if expert_storage not in allowed:
        raise DeepInferError(f"expert_storage={expert_storage!r} is not supported for {arch}; use "
                             f"{' or '.join(repr(a) for a in allowed)}")
    return expert_storage


def random_spec_arch(spec: str) -> str | None:
    """ARCH of a random:ARCH:PRESET:LAYERS spec (already checked), else None."""
    return spec.split(":")[1] if isinstance(spec, str) and spec.startswith("random:") else None


def drafter_of_spec(spec) -> str:
    """The draft method a checked model spec's model speculates with, as its family's config declares it (the
    embedded tiny model, a hub id: the default family's; a directory: its config.json's family)."""
    arch = random_spec_arch(spec)
    if arch is None and isinstance(spec, str) and Path(spec).is_dir():
        from .config import load_model_config
        try:
            return load_model_config(spec).DRAFT_METHOD
        except ConfigError:                       # loading the model says what is wrong with it
            pass
    return CONFIG_CLASSES[arch or ARCHS[0]].DRAFT_METHOD


def parse_dtype(dtype) -> torch.dtype:
    """A dtype name (DTYPE_NAMES) or a torch.dtype -> the torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise DeepInferError(f"dtype={dtype}: deepinfer computes in one of {', '.join(DTYPE_NAMES)}")
        return dtype
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise DeepInferError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    return DTYPES[dtype]


def check_device(device) -> str:
    """A device string the engine can use, or one line (unknown name, no CUDA build / GPU, index out of range)."""
    if not isinstance(device, (str, torch.device)):
        raise DeepInferError(f"device={device!r} is a {type(device).__name__}; use 'cpu', 'cuda' or 'cuda:N'")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeepInferError(f"device={device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeepInferError(f"device={str(device)!r}: no CUDA GPU is visible to this torch build "
                                 f"(torch {torch.__version__}); use cpu (or unset DEEPINFER_ACCELERATOR)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeepInferError(f"device={str(device)!r}: only {torch.cuda.device_count()} GPU(s) are visible")
    elif dev.type != "cpu":
        raise DeepInferError(f"device={str(device)!r}: deepinfer runs on cpu or cuda")
    return str(dev)


def device_or_default(device) -> str:
    """`device`, or DEEPINFER_ACCELERATOR's when None; checked either way."""
    from .env import accelerator
    return check_device(accelerator() if device is None else device)


def check_model_spec(model) -> str | os.PathLike | torch.nn.Module | None:
    """What `model=` may be: None (the embedded tiny model), a str / PathLike (MODEL_FORMS) or a built model
    holding `.checkpoint_dir`. A directory must exist and hold a config.json; whether a hub id can be fetched is
    found out when it loads."""
    if model is None:
        return None
    if isinstance(model, torch.nn.Module):
        from .models.base import CausalLM
        if not isinstance(model, CausalLM) or model.checkpoint_dir is None:
            raise DeepInferError("a model object passed to LLM needs .checkpoint_dir (a directory holding its "
                                 "tokenizer.json); load it with deepinfer.load_model")
        return model
    if isinstance(model, os.PathLike):
        return _located(model)
    if not isinstance(model, str):
        raise DeepInferError(f"model={model!r} is a {type(model).__name__}; give {MODEL_FORMS}")
    if not model.strip():
        raise DeepInferError(f"model={model!r} is empty; give {MODEL_FORMS}")
    if model.startswith("random:"):
        parse_random_spec(model)
        return model
    return model if model == EMBEDDED else _located(model)


def _located(model):
    from .checkpoint.hub import locate_model
    locate_model(model)
    return model


# ---- prompts and sampling params (LLM.generate) ----
def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _is_array(x) -> bool:
    return isinstance(x, torch.Tensor) or type(x).__module__ == "numpy"


def _as_ids(prompt):
    """A 1-D sequence of integer token ids (list, tuple, numpy / torch integer array) -> list[int]; else None."""
    if _is_array(prompt):
        integer = not prompt.dtype.is_floating_point and not prompt.dtype.is_complex and prompt.dtype != torch.bool \
            if isinstance(prompt, torch.Tensor) else prompt.dtype.kind in "iu"
        return [int(t) for t in prompt.tolist()] if getattr(prompt, "ndim", None) == 1 and integer else None
    if isinstance(prompt, (list, tuple)) and prompt:
        if set(map(type, prompt)) == {int}:  # plain ints, checked at C speed: a 32k prompt's ids in well under 1 ms
            return list(prompt)
        if all(_is_id(t) for t in prompt):
            return [int(t) for t in prompt]
    return None


PROMPT_FORMS = ("a string, a sequence of token ids (list, tuple or 1-D integer array), a {'prompt_token_ids': "
                "[...]} dict")


def prompt_list(prompts) -> list:
    """One prompt or a list of them -> a non-empty list of prompts (each still to be checked by `encode_prompt`).
    A flat sequence of integers is one prompt of token ids, never one prompt per integer."""
    if isinstance(prompts, (str, dict)) or _as_ids(prompts) is not None:
        return [prompts]
    if _is_array(prompts):
        raise DeepInferError(f"prompts is a {getattr(prompts, 'ndim', '?')}-D {type(prompts).__name__} of "
                             f"{prompts.dtype}; give {PROMPT_FORMS}, or a list of these")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise DeepInferError(f"prompts must be {PROMPT_FORMS}, or a non-empty list of these; got "
                             f"{type(prompts).__name__}" + (" (empty)" if isinstance(prompts, (list, tuple)) else ""))
    if any(_is_id(p) for p in prompts):     # a token-id prompt with a stray item: blame the stray, not the ids
        j = next(j for j, p in enumerate(prompts) if not _is_id(p))
        raise DeepInferError(f"prompts mixes token ids with a {type(prompts[j]).__name__} at position {j}: a prompt "
                             f"of token ids holds integers only; a list of prompts holds {PROMPT_FORMS} only")
    return list(prompts)


def encode_prompt(i: int, prompt, tokenizer, vocab_size: int, max_model_len: int) -> tuple[str | None, list[int]]:
    """Prompt i -> (its text or None, its token ids), checked: not empty, ids in the vocabulary, room for one
    generated token within max_model_len. `tokenizer` None: text prompts are refused (skip_tokenizer_init)."""
    if isinstance(prompt, str):
        if not prompt:
            raise DeepInferError(f"prompt {i} is empty; give at least one character or token id")
        if tokenizer is None:
            raise DeepInferError(f"prompt {i} is text, but the engine was built with skip_tokenizer_init=True; "
                                 f"give token ids ({{'prompt_token_ids': [...]}})")
        text, ids = check_text(f"prompt {i}", prompt), tokenizer.encode(prompt).ids
    elif isinstance(prompt, dict):
        if set(prompt) != {"prompt_token_ids"}:
            raise DeepInferError(f"prompt {i} is a dict with keys {sorted(prompt)}; the dict form is "
                                 f"{{'prompt_token_ids': [...]}}")
        text, ids = None, _as_ids(prompt["prompt_token_ids"])
        if ids is None:
            raise DeepInferError(f"prompt {i}: prompt_token_ids must be a non-empty sequence of integer token ids")
    else:
        text, ids = None, _as_ids(prompt)
        if ids is None and isinstance(prompt, (list, tuple)) and not prompt:
            raise DeepInferError(f"prompt {i} is empty (no token ids); give at least one token id")
        if ids is None:
            raise DeepInferError(f"prompt {i} is a {type(prompt).__name__}; give {PROMPT_FORMS}")
    if not ids:
        raise DeepInferError(f"prompt {i} encodes to no tokens; give a longer prompt")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        raise DeepInferError(f"prompt {i} holds token ids outside 0..{vocab_size - 1}, e.g. {bad[:3]}")
    if len(ids) >= max_model_len:
        raise DeepInferError(f"prompt {i} has {len(ids)} tokens; max_model_len is {max_model_len}, which must leave "
                             f"room for at least one generated token: shorten it or raise max_model_len")
    return text, ids


def sampling_params_list(sp, n: int) -> list:
    """None, one SamplingParams, or one per prompt -> n SamplingParams."""
    from .sampling import SamplingParams
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if isinstance(sp, dict):
        raise DeepInferError("sampling_params is a dict; pass SamplingParams(**that_dict) (unknown keys are "
                             "named there)")
    if not isinstance(sp, (list, tuple)):
        raise DeepInferError(f"sampling_params is a {type(sp).__name__}; give a SamplingParams or a list of them, "
                             f"one per prompt")
    wrong = [f"{j} ({type(p).__name__})" for j, p in enumerate(sp) if not isinstance(p, SamplingParams)]
    if wrong:
        raise DeepInferError(f"sampling_params entries {', '.join(wrong[:3])} are not SamplingParams; build each "
                             f"with SamplingParams(...)")
    if len(sp) != n:
        raise DeepInferError(f"{len(sp)} SamplingParams for {n} prompt(s); give one for all, or one per prompt")
    return list(sp)


def check_checkpoint_arch(arch: str | None, ckpt_dir: Path, checkpoint_arch: str) -> None:
    """--arch given with --model: it must name the checkpoint's own family (config.json decides the model)."""
    if arch is not None and arch != checkpoint_arch and random_spec_arch(str(ckpt_dir)):
        raise DeepInferError(f"--arch {arch} but --model {ckpt_dir} builds a {checkpoint_arch} model; drop --arch, "
                             f"or name random:{arch}:... ")
    if arch is not None and arch != checkpoint_arch:
        raise DeepInferError(f"--arch {arch} but {ckpt_dir} holds a {checkpoint_arch} checkpoint (its config.json "
                             f"decides the model); drop --arch, or point --model at a {arch} checkpoint")
