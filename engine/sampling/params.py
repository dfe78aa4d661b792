"""SamplingParams: per-request decoding settings, shaped like vLLM's so that users' habits carry over.

Same names, defaults and ranges as `vllm.SamplingParams` for the fields we have. On purpose:
- top_k: 0 and -1 both mean "off" (vLLM accepts both); it is stored as -1.
- stop=None / "x" is stored as [] / ["x"]; stop_token_ids=None as [] (duplicates dropped, order kept).
- seed=-1 means None (as in vLLM); other seeds must be in [0, 2**63) so they fit an int64 on device.
  `seq_seed` is an alias keyword for `seed`.
- greedy means temperature == 0 exactly; tiny positive temperatures are kept as given (vLLM clamps
  values below 0.01 up to 0.01; here the sampler owns numerics). Greedy with n > 1 is rejected, as in vLLM.
- logprobs / prompt_logprobs=-1 (vLLM's "whole vocabulary") is not supported.
- so_args replaces vLLM's `structured_outputs`, in DeepInfer's spelling {"schema_type": "regex" | "json" |
  "ebnf" | "structural_tag", "schema": ...} (the one-key form {"regex": ...} is an alias); it is validated for
  shape here and stored canonical; the engine compiles it (engine/structured.py).
- Any other keyword (best_of, logit_bias, skip_special_tokens, ...) is an error, never silently ignored.
- Instances are frozen: derive variants with `clone(**changes)`, which validates again.
Every invalid value raises SamplingParamsError (a ValueError and a DeepInferError) in one line:
"<field>=<value!r>: <what is allowed>".
"""

from __future__ import annotations

import copy
import enum
import json
import math
import numbers
from dataclasses import dataclass, fields
from typing import Any, Optional

from ..errors import DeepInferError, did_you_mean
from ..text import check_text

SEED_LIMIT = 2**63
SO_TYPES = ("regex", "json", "ebnf", "structural_tag")     # engine/structured.py: what each schema is


class SamplingParamsError(DeepInferError, ValueError):
    """An invalid SamplingParams argument; the message names the field, the value and the allowed range."""


class SamplingType(enum.IntEnum):
    """How a request picks tokens (as vLLM's SamplingType)."""
    GREEDY = 0       # argmax; ties go to the lowest token id
    RANDOM = 1       # sampled with unseeded noise
    RANDOM_SEED = 2  # sampled with noise that depends only on (seed, position, token id)


def _fail(name: str, value: Any, allowed: str):
    text = repr(value)
    if len(text) > 120:
        text = text[:117] + "..."
    raise SamplingParamsError(f"{name}={text}: {allowed}")


def _int(name: str, value: Any, allowed: str, lo: int, none_ok: bool = False) -> Optional[int]:
    if value is None and none_ok:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < lo:
        _fail(name, value, allowed)
    return int(value)


def _float(name: str, value: Any, allowed: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not ok(float(value)):
        _fail(name, value, allowed)
    return float(value)


def _seed(name: str, value: Any) -> Optional[int]:
    if value is None:
        return None
    allowed = "must be None or an int in [0, 2**63) (-1 means None, as in vLLM)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(name, value, allowed)
    if int(value) == -1:
        return None
    if not 0 <= int(value) < SEED_LIMIT:
        _fail(name, value, allowed)
    return int(value)


def _stop(value: Any) -> list[str]:
    allowed = "must be None, a non-empty str or a list of non-empty str"
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        _fail("stop", value, allowed)
    return [check_text(f"stop string {j}", s) for j, s in enumerate(items)]


def _stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in value):
        _fail("stop_token_ids", value, "must be None or a list of ints >= 0")
    return list(dict.fromkeys(int(t) for t in value))


def _so_args(value: Any) -> Optional[dict]:
    """DeepInfer's spelling {"schema_type": t, "schema": s}, or the alias {t: s}; stored canonical."""
    if value is None:
        return None
    allowed = ('must be None, {"schema_type": "regex" | "json" | "ebnf" | "structural_tag", "schema": ...} or '
               'the one-key alias {"regex": ...}')
    if not isinstance(value, dict):
        _fail("so_args", value, allowed)
    if set(value) == {"schema_type", "schema"}:
        kind, schema = value["schema_type"], value["schema"]
    elif len(value) == 1:
        (kind, schema), = value.items()
    else:
        _fail("so_args", value, allowed)
    if kind not in SO_TYPES:
        _fail("so_args", value, allowed)
    if isinstance(schema, str):
        check_text(f"so_args {kind} schema", schema)
    if kind in ("json", "structural_tag"):
        try:
            if isinstance(schema, str):
                ok = isinstance(json.loads(schema), dict)
            else:
                ok = isinstance(schema, dict) and bool(json.dumps(schema, allow_nan=False))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            _fail("so_args", value, f'the {kind} schema must be a JSON-serializable dict or a str holding a JSON '
                                    f'object')
    elif not (isinstance(schema, str) and schema.strip()):
        _fail("so_args", value, f"the {kind} schema must be a non-empty str")
    return {"schema_type": kind, "schema": copy.deepcopy(schema)}


@dataclass(frozen=True, init=False)
class SamplingParams:
    """Decoding settings for one request: `SamplingParams(temperature=0.8, top_p=0.95, max_tokens=128)`.

    Keyword arguments only; unknown keywords and invalid values raise SamplingParamsError (a ValueError).
    """

    n: int = 1
    """Number of output sequences to return for the prompt (>= 1; must be 1 when greedy)."""
    temperature: float = 1.0
    """Logits are divided by it before sampling (>= 0). 0 means greedy: top_p/top_k/min_p are then ignored."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of top tokens whose probability sums to >= top_p ((0, 1]; 1 = off)."""
    top_k: int = -1
    """Keep only the top_k most likely tokens (>= 1; -1 or 0 = off, stored as -1)."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the most likely token's ([0, 1]; 0 = off)."""
    repetition_penalty: float = 1.0
    """Penalize tokens already in the prompt or the output, multiplicatively (> 0; 1 = off; > 1 repeats less)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token already in the output ([-2, 2]; 0 = off)."""
    frequency_penalty: float = 0.0
    """Subtract this times the token's count in the output from its logit ([-2, 2]; 0 = off)."""
    max_tokens: Optional[int] = 16
    """Most tokens to generate per sequence (>= 1); None = until max_model_len. vLLM's default is 16 too."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens were generated (0 <= min_tokens <= max_tokens)."""
    stop: Optional[list[str]] = None
    """Strings that end generation when produced; not included in the output text. Stored as a list."""
    stop_token_ids: Optional[list[int]] = None
    """Token ids that end generation when produced; kept in the output. Ids >= vocab are checked by the engine."""
    ignore_eos: bool = False
    """Keep generating past the EOS token (for benchmarks)."""
    seed: Optional[int] = None
    """Seed of this request's sampling noise; the same seed gives the same tokens whatever the batch (alias seq_seed)."""
    logprobs: Optional[int] = None
    """Return the log-probabilities of this many top tokens per output token, plus the sampled one (None = off)."""
    prompt_logprobs: Optional[int] = None
    """Return the log-probabilities of this many top tokens per prompt token, plus the prompt's own (None = off)."""
    so_args: Optional[dict] = None
    """Structured output: {"regex": str} | {"json": schema dict or str} | {"ebnf": str}. Validated for shape;
    the engine refuses it (one error line, before any work) until the structured-outputs work applies it."""

    __hash__ = None  # holds lists, like vLLM's: not hashable

    def __init__(self, **kwargs: Any) -> None:
        known = [f.name for f in fields(self)]
        unknown = sorted(set(kwargs) - set(known) - {"seq_seed"})
        if unknown:
            hint = did_you_mean(unknown, known + ["seq_seed"])
            hint = f" ({hint})" if hint else ""
            raise SamplingParamsError(f"unknown SamplingParams argument(s) {', '.join(unknown)}{hint}; "
                                      f"known: {', '.join(known)}, seq_seed (an alias of seed)")
        if "seq_seed" in kwargs:
            raw = kwargs.pop("seq_seed")
            alias = _seed("seq_seed", raw)
            if "seed" in kwargs and _seed("seed", kwargs["seed"]) != alias:
                raise SamplingParamsError(f"seed={kwargs['seed']!r} and seq_seed={raw!r} disagree: "
                                          "seq_seed is an alias of seed; give one of them")
            kwargs["seed"] = alias
        given = {f.name: kwargs.get(f.name, f.default) for f in fields(self)}
        for name, value in _validate(given).items():
            object.__setattr__(self, name, value)

    @property
    def seq_seed(self) -> Optional[int]:
        """Alias of `seed`."""
        return self.seed

    @property
    def uses_penalties(self) -> bool:
        """Any repetition / presence / frequency penalty (their counts: the committed output ids, plus a token still
        in flight counted on the device)."""
        return self.repetition_penalty != 1 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        """True when temperature == 0: argmax decoding, lowest token id on ties."""
        return self.temperature == 0.0

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM_SEED (seeded sampling) or RANDOM."""
        if self.greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def clone(self, **changes: Any) -> "SamplingParams":
        """A validated copy with `changes` applied (the instance itself is frozen)."""
        base = self.to_dict()
        if "seq_seed" in changes and "seed" not in changes:
            del base["seed"]
        return type(self)(**{**base, **changes})

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain JSON types (for logs and result rows); `SamplingParams(**d)` rebuilds it."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}


def _validate(v: dict[str, Any]) -> dict[str, Any]:
    """Check and normalize every field; raise SamplingParamsError on the first bad one."""
    out: dict[str, Any] = {}
    out["n"] = _int("n", v["n"], "must be an int >= 1", lo=1)
    out["temperature"] = _float("temperature", v["temperature"], "must be a finite number >= 0 (0 = greedy)",
                                lambda x: x >= 0)
    out["top_p"] = _float("top_p", v["top_p"], "must be a number in (0, 1] (1 = off)", lambda x: 0 < x <= 1)
    top_k = _int("top_k", v["top_k"], "must be an int >= 1, or -1 or 0 (off)", lo=-1)
    out["top_k"] = -1 if top_k == 0 else top_k
    out["min_p"] = _float("min_p", v["min_p"], "must be a number in [0, 1] (0 = off)", lambda x: 0 <= x <= 1)
    out["repetition_penalty"] = _float("repetition_penalty", v["repetition_penalty"],
                                       "must be a finite number > 0 (1 = off)", lambda x: x > 0)
    for name in ("presence_penalty", "frequency_penalty"):
        out[name] = _float(name, v[name], "must be a number in [-2, 2] (0 = off)", lambda x: -2 <= x <= 2)
    out["max_tokens"] = _int("max_tokens", v["max_tokens"], "must be an int >= 1, or None (until max_model_len)",
                             lo=1, none_ok=True)
    out["min_tokens"] = _int("min_tokens", v["min_tokens"], "must be an int >= 0", lo=0)
    if out["max_tokens"] is not None and out["min_tokens"] > out["max_tokens"]:
        _fail("min_tokens", v["min_tokens"], f"must be <= max_tokens={out['max_tokens']}")
    out["stop"] = _stop(v["stop"])
    out["stop_token_ids"] = _stop_token_ids(v["stop_token_ids"])
    if not isinstance(v["ignore_eos"], bool):
        _fail("ignore_eos", v["ignore_eos"], "must be a bool")
    out["ignore_eos"] = v["ignore_eos"]
    out["seed"] = _seed("seed", v["seed"])
    for name in ("logprobs", "prompt_logprobs"):
        out[name] = _int(name, v[name], "must be None or an int >= 0 (-1, all tokens, is not supported)",
                         lo=0, none_ok=True)
    out["so_args"] = _so_args(v["so_args"])
    if out["temperature"] == 0.0 and out["n"] > 1:
        _fail("n", v["n"], "must be 1 when temperature=0 (greedy decoding would return n identical outputs)")
    return out
