"""Structured outputs (engine/structured.py) on the tiny random models, CPU: `so_args` in DeepInfer's spelling
through xgrammar. Every output that ends with "stop" parses and validates (JSON schema: the `jsonschema`
package; regex: fullmatch; EBNF: in the language) over seeds and temperatures; no output is refused by its
grammar; unconstrained rows keep their bits when constrained rows share the batch (batch-invariant mode); a
schema that does not compile and the refused combinations are one line before any work; rollback restores the
matcher exactly; n > 1, logprobs and stop strings work with a grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.errors import DeepInferError

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "n", "items"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "items": {"type": "array", "maxItems": 3,
                                   "items": {"type": "object", "required": ["id"], "additionalProperties": False,
                                             "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                            "tag": {"enum": ["a", "b"]}}}}}}
# patterns, a nested object, an array with both bounds, numbers and a nullable field
SCHEMA_PATTERNS = {"type": "object", "additionalProperties": False, "required": ["id", "where", "codes"],
                   "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                                  "where": {"type": "object", "additionalProperties": False, "required": ["lat"],
                                            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                           "note": {"type": ["string", "null"],
                                                                    "pattern": "^[a-z ]*$"}}},
                                  "codes": {"type": "array", "minItems": 1, "maxItems": 4,
                                            "items": {"type": "integer", "minimum": 100, "maximum": 999}}}}
REGEX = r"(cat|dog)s? [0-9]{1,3}( and (cat|dog))?"
EBNF = 'root ::= answer | answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z]{1,8}'
EBNF_RE = r"(yes|no)( because [a-z]{1,8})?"


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def llm(request):
    return LLM(embedded_tiny_dir(request.param))


def _runs(so_args, max_tokens, seeds=range(4), temps=(0.0, 0.7, 1.3)):
    return [SamplingParams(max_tokens=max_tokens, temperature=t, seed=s, so_args=so_args)
            for t in temps for s in (seeds if t else [0])]


@pytest.mark.parametrize("schema", [SCHEMA, SCHEMA_PATTERNS], ids=["enums-arrays", "patterns-numbers"])
def test_json_schema_outputs_validate(llm, schema):
    params = _runs({"schema_type": "json", "schema": schema}, 160, seeds=range(3), temps=(0.0, 1.0))
    outs = [o.outputs[0] for o in llm.generate(["Give me JSON:"] * len(params), params, use_tqdm=False)]
    reasons = [o.finish_reason for o in outs]
    assert "grammar_dead_end" not in reasons
    assert reasons.count("stop") >= len(outs) // 2, reasons       # the rest ran out of max_tokens mid-value
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)         # strict JSON: no raw control characters


def test_json_schema_as_text_and_the_alias_give_the_same_output(llm):
    sp = dict(max_tokens=40, temperature=0.9, seed=3)
    a = llm.generate("x", SamplingParams(**sp, so_args={"schema_type": "json", "schema": SCHEMA}), use_tqdm=False)
    b = llm.generate("x", SamplingParams(**sp, so_args={"json": json.dumps(SCHEMA)}), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids


@pytest.mark.parametrize("kind,schema,pattern", [("regex", REGEX, REGEX), ("ebnf", EBNF, EBNF_RE)])
def test_regex_and_ebnf_outputs_match(llm, kind, schema, pattern):
    params = _runs({"schema_type": kind, "schema": schema}, 40)
    for out in llm.generate(["q"] * len(params), params, use_tqdm=False):
        o = out.outputs[0]
        assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), (o.text, o.finish_reason)


def test_the_only_legal_token_is_never_masked(llm):
    """A regex with one possible output: greedy and sampled draws both spell it, then stop."""
    for t in (0.0, 1.5):
        o = llm.generate("q", SamplingParams(temperature=t, seed=1, max_tokens=30,
                                             so_args={"regex": "exactly this"}), use_tqdm=False)[0].outputs[0]
        assert o.text == "exactly this" and o.finish_reason == "stop"


def test_special_tokens_are_never_legal_inside_the_text(llm):
    """A grammar naming the pad token's text: the special token itself (dropped by decoding) is never drawn, so
    every complete output's text matches its grammar (review finding: pad + "ab" had decoded to "ab")."""
    pad = "<｜▁pad▁｜>"
    specials = {i for i, t in llm.tokenizer.get_added_tokens_decoder().items() if t.special}
    params = _runs({"regex": f"({re.escape(pad)}|z)ab"}, 16, seeds=range(6), temps=(1.5,))
    for out in llm.generate(["q"] * len(params), params, use_tqdm=False):
        o = out.outputs[0]
        assert not specials & set(o.token_ids[:-1]), o.token_ids            # the last one may be EOS
        if o.finish_reason == "stop":
            assert re.fullmatch(f"({re.escape(pad)}|z)ab", o.text), o.text


def test_unconstrained_rows_keep_their_bits_beside_constrained_ones():
    """Batch-invariant mode: a free row's tokens equal the same request run alone, with constrained rows around
    it (their masks touch their own rows only); a seeded constrained request gives the same output alone and in
    the mixed batch."""
    llm = LLM(embedded_tiny_dir("deepseek_v4"), kernel_backend="invariant")
    free = SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True)
    alone = llm.generate("the free one", free, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(["json", "the free one", "regex"], [
        SamplingParams(max_tokens=40, temperature=0.8, seed=1, so_args={"json": SCHEMA}), free,
        SamplingParams(max_tokens=12, temperature=0.8, seed=2, so_args={"regex": REGEX})], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    json_alone = llm.generate("json", SamplingParams(max_tokens=40, temperature=0.8, seed=1, so_args={"json": SCHEMA}),
                              use_tqdm=False)[0].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids == json_alone


def test_async_scheduling_reads_matchers_while_the_forward_runs():
    """Asynchronous scheduling with constrained rows: a step's forward is launched before the previous step is
    read; its masks are filled after (the runner's before_sample); outputs equal synchronous scheduling bitwise,
    constrained and free rows alike."""
    prompts = ["json", "free", "regex", "free two"]
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=1, so_args={"json": SCHEMA}),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, so_args={"regex": REGEX}),
              SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, repetition_penalty=1.3)]
    outs, deferred = {}, {}
    for on in (True, False):
        llm = LLM(embedded_tiny_dir("deepseek_v41"), async_scheduling=on)
        execute, calls = llm.engine.runner.execute, []

        def spy(batch, prev, before_sample=None, ring_marks=None, execute=execute, calls=calls):
            calls.append(before_sample is not None)
            return execute(batch, prev, before_sample, ring_marks)
        llm.engine.runner.execute = spy
        res = llm.generate(prompts, params, use_tqdm=False)
        outs[on] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in res]
        deferred[on] = sum(calls)
    assert outs[True] == outs[False]
    assert deferred[True] >= 10 and deferred[False] == 0


def test_n_logprobs_and_stop_strings_with_a_grammar(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, logprobs=2, stop=[" and"],
                        so_args={"regex": REGEX})
    outs = llm.generate("q", sp, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for o in outs:
        assert o.finish_reason == "stop" and re.fullmatch(r"(cat|dog)s? [0-9]{1,3}", o.text), o.text
        assert len(o.logprobs) == len(o.token_ids)
        for tok, entry in zip(o.token_ids, o.logprobs):
            assert entry[tok].logprob > -float("inf")              # the masked distribution: illegal ones are -inf


@pytest.mark.parametrize("so_args,why", [
    ({"regex": "(unclosed"}, "request 1: so_args regex schema does not compile: "),
    ({"json": '{"type": "objec"}'}, "request 1: so_args json schema does not compile: "),
    ({"ebnf": 'root ::= "a" |'}, "request 1: so_args ebnf schema does not compile: "),
])
def test_a_schema_that_does_not_compile_is_one_line_before_any_work(llm, so_args, why):
    steps = llm.stats.steps
    with pytest.raises(DeepInferError) as err:
        llm.generate(["a", "b"], [SamplingParams(max_tokens=3), SamplingParams(so_args=so_args)], use_tqdm=False)
    msg = str(err.value)
    assert msg.startswith(why) and "\n" not in msg and "/project/" not in msg, msg
    assert llm.stats.steps == steps and not llm.engine.has_unfinished()


def test_refused_combinations_are_one_line():
    llm = LLM(embedded_tiny_dir("deepseek_v4"), skip_tokenizer_init=True)
    with pytest.raises(DeepInferError, match="request 0: so_args compiles its grammar over the tokenizer"):
        llm.generate([[5, 6]], SamplingParams(so_args={"regex": "a"}), use_tqdm=False)
    with pytest.raises(ValueError, match="so_args="):
        SamplingParams(so_args={"schema_type": "yaml", "schema": "a"})
    with pytest.raises(DeepInferError, match="so_args with ignore_eos=True"):
        LLM(embedded_tiny_dir("deepseek_v4")).generate(
            "x", SamplingParams(so_args={"regex": "a"}, ignore_eos=True), use_tqdm=False)


def test_generate_cli_so_regex_and_the_example():
    import subprocess
    import sys
    from pathlib import Path
    cli = [sys.executable, "-c", "from deepinfer.cli import main; main()", "generate", "--model",
           str(embedded_tiny_dir("deepseek_v41")), "--prompt", "Phone:", "--so-regex", "[0-9]{3}-[0-9]{4}",
           "--temperature", "1", "--seed", "4", "--json"]
    ok = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout.splitlines()[-1])["outputs"][0]
    assert out["finish_reason"] == "stop" and re.fullmatch("[0-9]{3}-[0-9]{4}", out["text"])
    example = Path(__file__).parent.parent / "examples" / "structured_output.py"
    ran = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert any(line.startswith("regex") and "stop" in line for line in lines) and any("parsed:" in l for l in lines)


def test_rollback_restores_the_matcher_exactly(llm):
    from deepinfer.structured import Grammars
    g = Grammars(llm.tokenizer, llm.model.cfg.vocab_size, [llm.model.cfg.eos_token_id])
    m = g.matcher(g.compiled("test", {"schema_type": "regex", "schema": REGEX}))
    bits = lambda: (lambda b: (m.fill(b, 0), b)[1])(g.xgr.allocate_token_bitmask(1, g.vocab_size))  # noqa: E731
    ids = llm.tokenizer.encode("dogs 42 and cat", add_special_tokens=False).ids
    masks = [bits()]
    for t in ids:
        assert m.accept(t)
        masks.append(bits())
    for k in range(len(ids), 0, -1):
        m.rollback(1)
        assert torch.equal(bits(), masks[k - 1]), k
    (x,) = llm.tokenizer.encode("x", add_special_tokens=False).ids
    assert not m.accept(x)                                          # illegal first: refused, the matcher unchanged
    assert torch.equal(bits(), masks[0])
    g.close()


def test_the_compiled_grammar_cache_drops_the_least_recently_used():
    from deepinfer.structured import Grammars
    llm = LLM(embedded_tiny_dir("deepseek_v4"))
    g = Grammars(llm.tokenizer, llm.model.cfg.vocab_size, [llm.model.cfg.eos_token_id], cache_bytes=1)
    so = [{"schema_type": "regex", "schema": f"[a-z]{{{k}}}"} for k in (1, 2, 3)]
    first = g.compiled("r", so[0])
    assert g.submit(so[0]).result() is first                        # a hit: not compiled again
    g.compiled("r", so[1])
    keys = list(g._compiled)
    assert keys == [("regex", "[a-z]{2}")]                         # over 1 byte: the older one went
    m = g.matcher(first)                                           # a matcher keeps its grammar alive
    g.compiled("r", so[2])
    assert list(g._compiled) == [("regex", "[a-z]{3}")]
    (a,) = llm.tokenizer.encode("a", add_special_tokens=False).ids
    assert m.accept(a)
    big = Grammars(llm.tokenizer, llm.model.cfg.vocab_size, [llm.model.cfg.eos_token_id])
    for s in so:
        big.compiled("r", s)
    big.submit(so[0])                                              # used again: now the most recent
    assert list(big._compiled) == [("regex", "[a-z]{2}"), ("regex", "[a-z]{3}"), ("regex", "[a-z]{1}")]
    g.close()
    big.close()
