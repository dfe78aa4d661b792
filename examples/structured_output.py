"""Structured outputs with so_args (docs/structured-outputs.md): a JSON schema, a regex, an EBNF grammar and a
tool call through a structural tag, on the embedded tiny model (CPU, seconds). A random tiny model writes
nonsense, but always nonsense of the requested shape.

    python examples/structured_output.py [--model DIR|tiny]
"""

from __future__ import annotations

import argparse
import json

from deepinfer import LLM, SamplingParams
from deepinfer.cli import run_cli

# the name bounded by a pattern: a random model would otherwise run out of tokens in it (xgrammar 0.2.9 compiles
# maxLength so that it admits raw control characters: docs/structured-outputs.md)
USER = {"type": "object", "additionalProperties": False, "required": ["name", "age", "role"],
        "properties": {"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "role": {"enum": ["admin", "user", "guest"]}}}
WEATHER_CALL = {"type": "object", "required": ["city"], "additionalProperties": False,
                "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "unit": {"enum": ["C", "F"]}}}
TOOL_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [{
        "begin": "<tool_call>{\"name\": \"get_weather\", \"arguments\": ",
        "content": {"type": "json_schema", "json_schema": WEATHER_CALL},
        "end": "}</tool_call>"}]}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    llm = LLM(ap.parse_args().model)
    cases = {
        "json schema": SamplingParams(max_tokens=120, temperature=0.7, seed=1,
                                      so_args={"schema_type": "json", "schema": USER}),
        "regex": SamplingParams(max_tokens=20, temperature=0.7, seed=2,
                                so_args={"schema_type": "regex", "schema": r"\+1 [0-9]{3}-[0-9]{4}"}),
        "ebnf": SamplingParams(max_tokens=20, temperature=0.7, seed=3,
                               so_args={"schema_type": "ebnf", "schema": 'root ::= ("yes" | "no") "." '}),
        "tool call (structural tag)": SamplingParams(max_tokens=80, temperature=0.7, seed=4,
                                                     so_args={"schema_type": "structural_tag", "schema": TOOL_TAG}),
    }
    outs = llm.generate(["Answer:"] * len(cases), list(cases.values()), use_tqdm=False)
    for name, out in zip(cases, outs):
        o = out.outputs[0]
        print(f"{name:28} {o.finish_reason:7} {o.text!r}")
    user = outs[0].outputs[0]
    if user.finish_reason == "stop":
        print("parsed:", json.loads(user.text))


if __name__ == "__main__":
    run_cli(main)      # bad input: one error line, exit 2 (docs/errors.md)
