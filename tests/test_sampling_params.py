"""SamplingParams: vLLM's defaults, one-line ValueErrors naming the field for every bad value, unknown keywords,
the seq_seed alias, normalization, so_args shapes, clone and a JSON round trip of to_dict."""

from __future__ import annotations

import copy
import json
import math
import pickle

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.sampling import SamplingParams
from deepinfer.sampling.params import SamplingParamsError, SamplingType

# vllm.SamplingParams defaults, written down from vllm/sampling_params.py: n=1, presence/frequency_penalty=0.0,
# repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0 (older releases: -1; both mean off, we store -1),
# min_p=0.0, seed=None, stop=None -> [], stop_token_ids=None -> [], ignore_eos=False, max_tokens=16,
# min_tokens=0, logprobs=None, prompt_logprobs=None, structured_outputs=None (our so_args).
VLLM_DEFAULTS = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                     presence_penalty=0.0, frequency_penalty=0.0, max_tokens=16, min_tokens=0, stop=[],
                     stop_token_ids=[], ignore_eos=False, seed=None, logprobs=None, prompt_logprobs=None,
                     so_args=None)


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert sp.to_dict() == VLLM_DEFAULTS
    assert not sp.greedy and sp.sampling_type is SamplingType.RANDOM


def test_valid_values_kept_and_normalized():
    sp = SamplingParams(n=3, temperature=2, top_p=0.5, top_k=0, min_p=1, repetition_penalty=1.3,
                        presence_penalty=-2, frequency_penalty=2, max_tokens=None, min_tokens=7,
                        stop=("a", "bc"), stop_token_ids=[5, 0, 5], ignore_eos=True, seed=0,
                        logprobs=0, prompt_logprobs=5)
    assert sp.temperature == 2.0 and isinstance(sp.temperature, float)
    assert isinstance(sp.min_p, float) and isinstance(sp.presence_penalty, float)
    assert sp.top_k == -1  # 0 and -1 both mean "off"; stored as -1
    assert SamplingParams(top_k=-1).top_k == -1 and SamplingParams(top_k=1).top_k == 1
    assert sp.max_tokens is None and sp.min_tokens == 7
    assert sp.stop == ["a", "bc"] and sp.stop_token_ids == [5, 0]
    assert sp.sampling_type is SamplingType.RANDOM_SEED


def test_greedy_and_sampling_type():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY
    assert not SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


@pytest.mark.parametrize("stop, expect", [(None, []), ("###", ["###"]), (["a", "b"], ["a", "b"]),
                                          (("x",), ["x"]), ([], [])])
def test_stop_normalized_to_list(stop, expect):
    assert SamplingParams(stop=stop).stop == expect


INVALID = [
    ("n", 0), ("n", -1), ("n", 1.0), ("n", True), ("n", "2"),
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", True), ("temperature", None),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", "1"),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True), ("top_k", None),
    ("min_p", -0.01), ("min_p", 1.5), ("min_p", "0"),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", -2.01), ("presence_penalty", 2.5), ("presence_penalty", None),
    ("frequency_penalty", 3), ("frequency_penalty", -3), ("frequency_penalty", "0"),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 10.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", None),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", {"a": 1}), ("stop", b"x"),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("stop_token_ids", "12"),
    ("ignore_eos", 1), ("ignore_eos", "yes"), ("ignore_eos", None),
    ("seed", 1.5), ("seed", 2.0), ("seed", "42"), ("seed", True), ("seed", -2), ("seed", 2**63),
    ("seq_seed", 1.5), ("seq_seed", False),
    ("logprobs", -1), ("logprobs", 1.0), ("logprobs", True), ("logprobs", "5"),
    ("prompt_logprobs", -1), ("prompt_logprobs", 0.5), ("prompt_logprobs", False),
    ("so_args", "regex"), ("so_args", {}), ("so_args", {"regex": "a", "ebnf": "b"}), ("so_args", {"grammar": "x"}),
    ("so_args", {"regex": 3}), ("so_args", {"regex": ""}), ("so_args", {"ebnf": None}), ("so_args", {"ebnf": "  "}),
    ("so_args", {"json": "not json"}), ("so_args", {"json": "[1, 2]"}), ("so_args", {"json": 5}),
    ("so_args", {"json": {"x": object()}}), ("so_args", {"json": {"x": math.nan}}),
    ("so_args", {"schema_type": "regexp", "schema": "a"}), ("so_args", {"schema_type": "regex"}),
    ("so_args", {"schema_type": "regex", "schema": "a", "extra": 1}), ("so_args", {"schema_type": "json", "schema": 3}),
    ("so_args", {"structural_tag": "not json"}),
]


@pytest.mark.parametrize("field, value", INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_one_line_error_naming_field(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{field}=")
    assert isinstance(info.value, SamplingParamsError) and isinstance(info.value, DeepInferError)


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(min_tokens=17), "min_tokens", "max_tokens=16"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "max_tokens=4"),
    (dict(n=2, temperature=0), "n", "temperature=0"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(temperature=-1), "temperature", ">= 0"),
    (dict(presence_penalty=9), "presence_penalty", "[-2, 2]"),
])
def test_error_names_field_and_range(kwargs, field, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{field}=") and words in msg and "\n" not in msg


def test_min_tokens_without_max_tokens_limit():
    assert SamplingParams(max_tokens=None, min_tokens=10_000).min_tokens == 10_000
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5


def test_long_value_is_truncated_in_message():
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=["ok"] * 500 + [""])
    assert len(str(info.value)) < 400


def test_unknown_kwargs_named_with_known_list():
    with pytest.raises(ValueError) as info:
        SamplingParams(temprature=0.5, best_of=2)
    msg = str(info.value)
    assert "\n" not in msg and "temprature" in msg and "best_of" in msg
    assert "did you mean temperature" in msg
    for name in VLLM_DEFAULTS:
        assert name in msg
    assert "seq_seed" in msg


def test_positional_arguments_rejected():
    with pytest.raises(TypeError):
        SamplingParams(1)


def test_seed_alias():
    assert SamplingParams(seq_seed=7).seed == 7
    assert SamplingParams(seed=7).seq_seed == 7
    assert SamplingParams(seed=7, seq_seed=7).seed == 7
    assert SamplingParams(seq_seed=None).seed is None
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert "seq_seed" not in SamplingParams(seq_seed=7).to_dict()


@pytest.mark.parametrize("seed, seq_seed", [(1, 2), (None, 3), (3, None), (1, True)])
def test_seed_alias_conflict(seed, seq_seed):
    with pytest.raises(ValueError) as info:
        SamplingParams(seed=seed, seq_seed=seq_seed)
    msg = str(info.value)
    assert "\n" not in msg and ("seq_seed" in msg)


@pytest.mark.parametrize("so_args,canonical", [
    ({"schema_type": "regex", "schema": r"\d{3}-\d{4}"}, None),
    ({"schema_type": "json", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}, None),
    ({"schema_type": "json", "schema": '{"type": "object"}'}, None),
    ({"schema_type": "ebnf", "schema": 'root ::= "yes" | "no"'}, None),
    ({"schema_type": "structural_tag", "schema": {"type": "structural_tag", "format": {"type": "const_string",
                                                                                        "value": "x"}}}, None),
    ({"regex": r"\d{3}"}, {"schema_type": "regex", "schema": r"\d{3}"}),                 # the one-key alias
    ({"json": '{"type": "object"}'}, {"schema_type": "json", "schema": '{"type": "object"}'}),
])
def test_so_args_valid_shapes(so_args, canonical):
    sp = SamplingParams(so_args=so_args)
    want = canonical or so_args
    assert sp.so_args == want and sp.so_args is not so_args  # copied: later edits by the caller don't leak in
    assert json.loads(json.dumps(sp.to_dict()))["so_args"] == want
    assert SamplingParams(**sp.to_dict()).so_args == want


def test_so_args_copied_in():
    schema = {"type": "object"}
    sp = SamplingParams(so_args={"schema_type": "json", "schema": schema})
    schema["type"] = "array"
    assert sp.so_args == {"schema_type": "json", "schema": {"type": "object"}}


def test_frozen_and_clone_validates():
    sp = SamplingParams(temperature=0.8, stop="x", seed=5)
    with pytest.raises(AttributeError):
        sp.temperature = 0.0
    c = sp.clone(top_p=0.9)
    assert c.top_p == 0.9 and c.temperature == 0.8 and c.stop == ["x"] and c.seed == 5
    assert sp.top_p == 1.0 and c != sp and sp.clone() == sp
    assert sp.clone(seq_seed=9).seed == 9
    assert sp.clone(stop="y").stop == ["y"]
    with pytest.raises(ValueError, match=r"^top_p="):
        sp.clone(top_p=0)
    with pytest.raises(ValueError, match="bogus"):
        sp.clone(bogus=1)
    with pytest.raises(ValueError, match=r"^n="):
        SamplingParams(n=4).clone(temperature=0)


def test_to_dict_json_round_trip():
    sp = SamplingParams(n=2, temperature=0.6, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
                        presence_penalty=0.5, frequency_penalty=-0.5, max_tokens=None, min_tokens=3,
                        stop=["\n\n", "END"], stop_token_ids=[2, 7], ignore_eos=True, seq_seed=1234,
                        logprobs=5, prompt_logprobs=0, so_args={"json": {"type": "object"}})
    d = sp.to_dict()
    assert list(d) == list(VLLM_DEFAULTS)
    back = SamplingParams(**json.loads(json.dumps(d)))
    assert back == sp and back.to_dict() == d
    d["stop"].append("mutated")
    d["so_args"]["schema"]["type"] = "array"
    assert sp.stop == ["\n\n", "END"] and sp.so_args == {"schema_type": "json", "schema": {"type": "object"}}


def test_pickle_and_deepcopy():
    sp = SamplingParams(temperature=0.3, stop="s", seed=1, so_args={"regex": "a+"})
    assert pickle.loads(pickle.dumps(sp)) == sp
    assert copy.deepcopy(sp) == sp


def test_numpy_scalars_accepted():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(5), seed=np.int64(3), stop_token_ids=[np.int32(2)])
    assert type(sp.temperature) is float and type(sp.top_k) is int and type(sp.seed) is int
    assert type(sp.stop_token_ids[0]) is int
    json.dumps(sp.to_dict())
