"""LLM.generate: continuous batching, chunked prefill and preemption give the tokens of one-at-a-time decoding;
transformers' greedy generate and log-softmax for V4; seeded sampling; stops; bad input.

float64 where batches of different composition must agree exactly: in fp32 the QAT steps turn GEMM rounding
differences between batch shapes into flips (docs/model.md); batch-invariant mode is what fixes fp32/bf16."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.errors import DeepInferError

PROMPTS = ["The quick brown fox", "a", "Once upon a time in a land far away, there lived", "12 + 30 =",
           "Hello", "What is the capital of France? It is", "z z z z z z z z z z z z z z", "In 1905, Einstein",
           "The cat", "Deep learning models", "x", "She said that the weather would be fine tomorrow and",
           "ok", "Numbers: 1 2 3 4 5 6 7", "The end.", "Why"]


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def llm(request):
    return LLM(embedded_tiny_dir(request.param), dtype="float64")


def one_at_a_time(llm, ids: list[int], n: int) -> list[int]:
    m, st, out = llm.model, llm.model.new_state(), []
    logits = m.extend([torch.tensor(ids)], [st])[0][-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = m.extend([torch.tensor([out[-1]])], [st])[0][-1]
    return out


def test_batched_chunked_preempted_greedy_equals_one_at_a_time(llm):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.args.update(max_num_batched_tokens=16, max_num_seqs=6, state_memory_bytes=150_000)
    try:
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        assert llm.last_run["preemptions"] > 0          # the small state budget forced recomputes
    finally:
        llm.args.update(max_num_batched_tokens=8192, max_num_seqs=256, state_memory_bytes=None)
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt).ids
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == one_at_a_time(llm, ids, 10), prompt
        assert out.outputs[0].finish_reason == "length" and out.finished
        m = out.metrics[0]
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == 10


def test_seeded_sampling_is_independent_of_the_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=123, max_tokens=8, n=2)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p in PROMPTS[:4]]
    together = llm.generate(PROMPTS[:4][::-1] + PROMPTS[4:8], sp, use_tqdm=False)[:4][::-1]
    for a, b in zip(alone, together):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert alone[0].outputs[0].token_ids != alone[0].outputs[1].token_ids     # the n samples use different seeds
    other = llm.generate(PROMPTS[0], sp.clone(seed=124), use_tqdm=False)[0]
    assert [o.token_ids for o in other.outputs] != [o.token_ids for o in alone[0].outputs]


def test_stops_and_lengths(llm):
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    toks = greedy[0].outputs[0].token_ids
    stopped = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                      stop_token_ids=[toks[2]]), use_tqdm=False)[0].outputs[0]
    first = toks.index(toks[2])
    assert stopped.token_ids == toks[:first + 1] and stopped.finish_reason == "stop" and stopped.stop_reason == toks[2]
    banned = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=6,
                                                     stop_token_ids=[toks[0]]), use_tqdm=False)[0].outputs[0]
    assert toks[0] not in banned.token_ids and len(banned.token_ids) == 6
    text = greedy[0].outputs[0].text
    if len(text.strip()) > 2:
        cut = text.strip()[1:3]
        s = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[cut]),
                         use_tqdm=False)[0].outputs[0]
        assert s.finish_reason == "stop" and s.stop_reason == cut and cut not in s.text


def test_inputs_in_every_shape_and_chat(llm):
    ids = llm.tokenizer.encode("The cat").ids
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a = llm.generate("The cat", sp, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(ids, sp, use_tqdm=False)[0].outputs[0].token_ids
    c = llm.generate([{"prompt_token_ids": ids}], [sp], use_tqdm=False)[0].outputs[0].token_ids
    assert a == b == c
    chat = llm.chat([{"role": "user", "content": "hi"}], sp, use_tqdm=False)[0]
    text = llm.tokenizer.decode(chat.prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<｜begin▁of▁sentence｜>") and text.endswith("<｜Assistant｜>") and "hi" in text


@pytest.mark.parametrize("prompts, params, match", [
    ("", None, "prompt 0 is empty"),
    ([[]], None, "prompt 0 is empty"),
    ([[5, 10**6]], None, "outside 0.."),
    ([[5, -1]], None, "outside 0.."),
    ([[5] * 5000], None, "max_model_len"),
    (["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], "one per prompt"),
    ([3.5], None, "prompt 0 is a float"),
])
def test_bad_requests_fail_before_any_work(llm, prompts, params, match):
    with pytest.raises(DeepInferError, match=match):
        llm.generate(prompts, params, use_tqdm=False)


def test_bad_engine_arguments():
    with pytest.raises(DeepInferError, match="unknown arguments"):
        LLM(embedded_tiny_dir("deepseek_v41"), max_num_seq=4)
    with pytest.raises(DeepInferError, match="max_num_seqs=0"):
        LLM(embedded_tiny_dir("deepseek_v41"), max_num_seqs=0)


def test_v4_greedy_and_prompt_logprobs_match_transformers():
    from tests.helpers import transformers_twin
    llm = LLM(embedded_tiny_dir("deepseek_v4"), dtype="float32", qat_fake_quant=False)
    twin = transformers_twin(llm.model)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    for prompt in PROMPTS[:6]:
        out = llm.generate(prompt, sp, use_tqdm=False)[0]
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = twin.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                eos_token_id=None, pad_token_id=2)[0, ids.shape[1]:].tolist()
            lp = torch.log_softmax(twin(ids).logits[0].float(), dim=-1)
        assert out.outputs[0].token_ids == ref, prompt
        assert out.prompt_logprobs[0] is None
        for j, entry in enumerate(out.prompt_logprobs[1:], start=1):
            tok = out.prompt_token_ids[j]
            assert abs(entry[tok] - lp[j - 1, tok].item()) <= 1e-4


def test_generate_cli(tmp_path):
    import json
    import subprocess
    import sys
    base = [sys.executable, "-c", "from deepinfer.cli import main; main()", "generate", "--model",
            str(embedded_tiny_dir("deepseek_v41"))]
    ok = subprocess.run(base + ["--prompt", "The cat", "--prompt", "Hi", "--max-tokens", "3", "--json"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    rows = [json.loads(line) for line in ok.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["The cat", "Hi"] and all(len(r["outputs"][0]["token_ids"]) == 3 for r in rows)
    bad = subprocess.run(base + ["--prompt", "x", "--temperature", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "temperature=-1.0" in bad.stderr
