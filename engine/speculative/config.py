"""What speculative decoding an engine runs: `LLM(speculative=...)`, else the upstream switches
DEEPINFER_USE_NEXTN_DECODE (draft cap; on when >= 1) and DEEPINFER_ENABLE_MTP_VARLEN (confidence-scheduled
verification). docs/speculative.md has the whole story.

    speculative = True | METHOD | {"method": METHOD, "num_speculative_tokens": 5, "schedule": "confidence",
                                      "acceptance": [0.79, 0.63, 0.49, 0.32, 0.28], "step_seconds": {1: 2.5e-3, ...}}

schedule: "fixed" (every draft verified: the comparison mode), "confidence" (Algorithm 1: per-request verify
lengths from the prefix survival of the confidences and the profiled step rate, early stop) or "budget" (the
production variant: the step's token budget from confidences two steps back, the top drafts by live survival).
acceptance: a pinned acceptance model for benchmarks on random weights (speculative/pinned.py): per-position survival
rates that decide acceptance while the real kernels run the real shapes.
method: the model's drafter (models/base.py DRAFT_METHODS; the model's own, Drafting.method, is the default)."""

from __future__ import annotations

from dataclasses import dataclass

from ..env import read
from ..errors import DeepInferError
from ..models.base import DRAFT_METHODS

SCHEDULES = ("fixed", "confidence", "budget")
_KEYS = ("method", "num_speculative_tokens", "schedule", "acceptance", "confidence_spread", "step_seconds")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = DRAFT_METHODS[0]            # the model's drafter (Drafting.method)
    num_speculative_tokens: int = 5           # drafts proposed a step (<= the drafter's block size)
    schedule: str = "fixed"
    acceptance: tuple[float, ...] | None = None   # pinned per-position survival (benchmarks); None: real acceptance
    confidence_spread: float = 1.0            # pinned model: how far per-draft odds spread around the rate, [0, 1]
    step_seconds: tuple[tuple[int, float], ...] | None = None   # the step-rate table; None: profiled at start

    @property
    def varlen(self) -> bool:
        return self.schedule != "fixed"


def speculation_label(config: SpeculativeConfig) -> str:
    """What rows call the setting (spec_mode): <method>-<schedule>-<drafts>, e.g. <method>-confidence-5."""
    return f"{config.method}-{config.schedule}-{config.num_speculative_tokens}"


def _check_fraction_list(name: str, value) -> tuple[float, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise DeepInferError(f"speculative {name}={value!r} must be a list of numbers")
    out = tuple(value)
    if not out or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1 for v in out):
        raise DeepInferError(f"speculative {name}={value!r} must be a non-empty list of numbers in [0, 1]")
    if any(b > a for a, b in zip(out, out[1:])):
        raise DeepInferError(f"speculative {name}={list(out)} must be non-increasing (the survival of draft j+1 "
                             f"cannot exceed that of draft j)")
    return tuple(float(v) for v in out)


def speculative_config(value, block_size: int | None, drafter: str | None) -> SpeculativeConfig | None:
    """LLM's `speculative` (None: the environment decides) -> a SpeculativeConfig, or None when off. block_size: the
    model's draft block (None: the model cannot draft; asking for speculation is then one error line); drafter:
    the model's draft method."""
    env_cap, env_varlen = read("DEEPINFER_USE_NEXTN_DECODE"), read("DEEPINFER_ENABLE_MTP_VARLEN")
    if value is None:
        if not env_cap and env_varlen:
            raise DeepInferError("DEEPINFER_ENABLE_MTP_VARLEN=1 schedules speculative verification, which is off: "
                                 "set DEEPINFER_USE_NEXTN_DECODE=N (or LLM(speculative=...)), or unset it")
        value = {} if env_cap else False
    elif value is False and (env_cap or env_varlen):
        # the switches ask for speculation that the argument turns off: refused, not silently dropped
        switches = " and ".join(f"{k}={v}" for k, v in (("DEEPINFER_USE_NEXTN_DECODE", env_cap),
                                                         ("DEEPINFER_ENABLE_MTP_VARLEN", int(env_varlen))) if v)
        raise DeepInferError(f"speculative=False turns speculative decoding off, but {switches} ask for it: unset "
                             f"the variable(s), or leave speculative out to apply them")
    if value is False:
        return None
    if value is True or value in DRAFT_METHODS:
        value = {} if value is True else {"method": value}
    if not isinstance(value, dict):
        raise DeepInferError(f"speculative={value!r}: use True, a draft method {list(DRAFT_METHODS)}, None/False (off) "
                             f"or a dict with keys "
                             f"{list(_KEYS)}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise DeepInferError(f"speculative got unknown keys {unknown}; known: {list(_KEYS)}")
    if block_size is None:
        raise DeepInferError("speculative decoding needs a model that drafts (num_nextn_predict_layers >= 1: draft "
                             "layers in the checkpoint); this one has none: drop speculative / "
                             "DEEPINFER_USE_NEXTN_DECODE (docs/speculative.md)")
    method = value.get("method", drafter)
    if method not in DRAFT_METHODS:
        raise DeepInferError(f"speculative method={method!r} is not supported; use one of {list(DRAFT_METHODS)}")
    if method != drafter:
        raise DeepInferError(f"speculative method={method!r}: this model drafts with {drafter!r}; use {drafter!r} or "
                             f"leave method out (docs/speculative.md)")
    n = value.get("num_speculative_tokens", env_cap or block_size)
    if env_cap and "num_speculative_tokens" in value and n != env_cap:
        raise DeepInferError(f"speculative num_speculative_tokens={n!r} and DEEPINFER_USE_NEXTN_DECODE={env_cap} "
                             f"disagree: drop one of them")
    if env_cap and "num_speculative_tokens" not in value and env_cap > block_size:
        raise DeepInferError(f"DEEPINFER_USE_NEXTN_DECODE={env_cap} is more drafts than this model's draft block "
                             f"({block_size}): use 1..{block_size}")
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= block_size:
        raise DeepInferError(f"num_speculative_tokens={n!r} must be an integer in 1..{block_size} (the model's "
                             f"draft block)")
    schedule = value.get("schedule", "confidence" if env_varlen else "fixed")
    if env_varlen and schedule == "fixed":
        raise DeepInferError("speculative schedule='fixed' verifies every draft, but DEEPINFER_ENABLE_MTP_VARLEN=1 "
                             "asks for variable-length verification: unset it, or use schedule 'confidence' or "
                             "'budget'")
    if schedule not in SCHEDULES:
        raise DeepInferError(f"speculative schedule={schedule!r}: use one of {list(SCHEDULES)}")
    acceptance = value.get("acceptance")
    if acceptance is not None:
        acceptance = _check_fraction_list("acceptance", acceptance)
        if len(acceptance) < n:
            raise DeepInferError(f"speculative acceptance has {len(acceptance)} positions; give one survival rate "
                                 f"per draft ({n})")
    if "confidence_spread" in value and acceptance is None:
        raise DeepInferError("speculative confidence_spread shapes the pinned acceptance model: give acceptance too, "
                             "or drop confidence_spread")
    if value.get("step_seconds") is not None and schedule == "fixed":
        raise DeepInferError("speculative step_seconds is the verify schedule's step rate; schedule 'fixed' verifies "
                             "every draft and reads none: use schedule 'confidence' or 'budget', or drop step_seconds")
    spread = value.get("confidence_spread", 1.0)
    if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not 0 <= spread <= 1:
        raise DeepInferError(f"speculative confidence_spread={spread!r} must be a number in [0, 1] (0: every draft "
                             f"alike, 1: confidences spread over (0, 1))")
    table = value.get("step_seconds")
    if table is not None:
        if not isinstance(table, dict) or not table or any(
                isinstance(k, bool) or not isinstance(k, int) or k < 1 or isinstance(v, bool)
                or not isinstance(v, (int, float)) or v <= 0 for k, v in table.items()):
            raise DeepInferError(f"speculative step_seconds={table!r} must map batch token counts (int >= 1) to "
                                 f"seconds per step (> 0)")
        table = tuple(sorted((int(k), float(v)) for k, v in table.items()))
    return SpeculativeConfig(method, n, schedule, acceptance, float(spread), table)
