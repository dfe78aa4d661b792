"""Prefix caching on a CUDA device (`-m gpu`) with the Triton kernel tables (issue 38's output targets on the GPU
kernel sets; tests/test_prefix_cache.py checks the same on CPU): prompts that part from a cached one inside a block,
generated for 256 tokens, against the cache-free engine: with the batch-invariant table (`triton_invariant`) tokens
and logprobs are bitwise equal; with the default table (`triton`) the greedy tokens are equal. Tiny V4 and V4.1,
bf16, the hits starting from the cached prompt's snapshot at 512, so each hit's tail runs in the cold prefill's last
piece (its first run, session 42, failed both default-table cases: the 256-token generation's decode snapshots had
pushed that snapshot out, the hits replayed R in other pieces, and V4's bf16 tokens departed at token 77; a
generation now keeps one decode snapshot, and both pass)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from tests.test_prefix_cache import _logprobs, _tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ARCHS = ["deepseek_v4", "deepseek_v41"]
TOKENS = 256


def _llm(arch: str, backend: str, cache: bool) -> LLM:
    return LLM(embedded_tiny_dir(arch), device="cuda", dtype="bfloat16", kernel_backend=backend, max_num_seqs=4,
               max_num_batched_tokens=256, max_model_len=1024, block_size=16, enable_prefix_caching=cache)


def _run(llm: LLM, prompt: list[int]):
    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    out = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    return out.token_ids, _logprobs(out)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("backend", ["triton_invariant", "triton"])
def test_outputs_with_a_hit_equal_outputs_without_on_the_gpu(arch, backend):
    base = _tokens(600, 0)
    parted = [base[:cut] + _tokens(40, 10 + cut) for cut in (517, 530, 555)]
    got, want = _llm(arch, backend, True), _llm(arch, backend, False)
    _run(got, base)
    got.engine.reset_stats()
    for prompt in parted:
        (tokens, logprobs), (ref_tokens, ref_logprobs) = _run(got, prompt), _run(want, prompt)
        assert tokens == ref_tokens
        if backend == "triton_invariant":
            assert logprobs == ref_logprobs
    stats = got.engine.stats
    assert stats.prefix_hit_tokens == 512 + 528 + 544           # whole blocks of 16 below each cut
    assert stats.prefix_snapshot_hits == 3                       # each from a snapshot (512, or its own hit's)
