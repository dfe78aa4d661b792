"""Structured outputs on a CUDA device (`-m gpu`): the mask path on the GPU (pinned bitmask, asynchronous copy,
xgrammar's CUDA kernel) equals masking on the CPU; the tiny models' constrained outputs on CUDA parse and
validate; asynchronous scheduling (masks filled while the next forward runs) gives the same outputs as
synchronous scheduling."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.structured import Grammars, apply_grammar_masks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
          "properties": {"a": {"enum": ["x", "y"]}, "b": {"type": "array", "maxItems": 3,
                                                          "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
REGEX = r"(cat|dog)s? [0-9]{1,3}"


@pytest.fixture(scope="module")
def llm():
    return LLM(embedded_tiny_dir("deepseek_v41"), device="cuda")


def test_cuda_masks_equal_cpu_masks(llm):
    """Two engines' worth of Grammars: the CPU one masks with its unpinned buffer, the GPU one with its pinned
    buffer, asynchronous copy and event (a buffer is pinned when first allocated for CUDA logits)."""
    g = Grammars(llm.tokenizer, llm.model.cfg.vocab_size, [llm.model.cfg.eos_token_id])
    gpu_side = Grammars(llm.tokenizer, llm.model.cfg.vocab_size, [llm.model.cfg.eos_token_id])
    so = [{"schema_type": "json", "schema": SCHEMA}, None, {"schema_type": "regex", "schema": REGEX}, None]
    ids = llm.tokenizer.encode('{"a": "x", "b": [1', add_special_tokens=False).ids
    for step in range(3):                      # the reused pinned buffer across steps and matcher states
        ms = [g.matcher(g.compiled("t", s)) if s else None for s in so]
        ms_gpu = [gpu_side.matcher(gpu_side.compiled("t", s)) if s else None for s in so]
        for t in ids[:step * 3]:
            assert ms[0].accept(t) and ms_gpu[0].accept(t)
        logits = torch.randn(4, llm.model.cfg.vocab_size, generator=torch.Generator().manual_seed(step))
        cpu, gpu = logits.clone(), logits.cuda()
        apply_grammar_masks(cpu, ms)
        apply_grammar_masks(gpu, ms_gpu)
        assert gpu_side.masks.host.is_pinned() and not g.masks.host.is_pinned()
        assert torch.equal(gpu.cpu(), cpu)
        assert torch.equal(cpu[1], logits[1]) and torch.isinf(cpu[0]).any() and torch.isinf(cpu[2]).any()
    g.close()
    gpu_side.close()


def test_constrained_outputs_on_cuda_parse_and_async_equals_sync(llm):
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, so_args={"json": SCHEMA})
              for t, s in ((0.0, 0), (0.8, 1), (1.2, 2))] + \
             [SamplingParams(max_tokens=16, temperature=0.9, seed=3, so_args={"regex": REGEX}),
              SamplingParams(max_tokens=16, temperature=0.9, seed=4, ignore_eos=True)]
    prompts = [f"p{i}" for i in range(len(params))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert "grammar_dead_end" not in [o.finish_reason for o in outs]
    for o in outs[:3]:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), SCHEMA)
    if outs[3].finish_reason == "stop":
        assert re.fullmatch(REGEX, outs[3].text), outs[3].text
    sync = LLM(embedded_tiny_dir("deepseek_v41"), device="cuda", async_scheduling=False)
    again = [o.outputs[0] for o in sync.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
