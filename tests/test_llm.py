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
from deepinfer.reference import extend, new_state

PROMPTS = ["The quick brown fox", "a", "Once upon a time in a land far away, there lived", "12 + 30 =",
           "Hello", "What is the capital of France? It is", "z z z z z z z z z z z z z z", "In 1905, Einstein",
           "The cat", "Deep learning models", "x", "She said that the weather would be fine tomorrow and",
           "ok", "Numbers: 1 2 3 4 5 6 7", "The end.", "Why"]


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def llm(request):
    return LLM(embedded_tiny_dir(request.param), dtype="float64")


_ONE_AT_A_TIME: dict = {}


def one_at_a_time(llm, ids: list[int], n: int) -> list[int]:
    """Greedy reference decoding of one sequence (cached: several tests compare against it)."""
    key = (llm.model.cfg.model_type, tuple(ids), n)
    if key not in _ONE_AT_A_TIME:
        _ONE_AT_A_TIME[key] = _decode_alone(llm, ids, n)
    return _ONE_AT_A_TIME[key]


def _decode_alone(llm, ids: list[int], n: int) -> list[int]:
    m, st, out = llm.model, new_state(llm.model), []
    logits = extend(m, [torch.tensor(ids)], [st])[0][-1]
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = extend(m, [torch.tensor([out[-1]])], [st])[0][-1]
    return out


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batched_chunked_preempted_greedy_equals_one_at_a_time(llm, async_scheduling):
    check_preempted_run(llm, "cpu", async_scheduling)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_async_preempted_greedy_equals_one_at_a_time(llm):
    """The same on the GPU: decode through CUDA graphs, asynchronous scheduling, slots reused after preemption
    while the previous step may still run; tokens equal the CPU reference decoding."""
    small = check_preempted_run(llm, "cuda", True)
    assert small.stats.cuda_graphs and small.stats.graphs_captured


def check_preempted_run(llm, device: str, async_scheduling: bool):
    """16 prompts, 6 seats, a 16-token step budget and state pools with room for 7 blocks of 16 tokens: sequences
    of 22-49 tokens need 2-4 blocks each, so the pools run out and the newest sequences are preempted and
    recomputed. Every output equals greedy one-at-a-time reference decoding (float64)."""
    from deepinfer.cache.pools import PoolLayout
    lay = PoolLayout.for_model(llm.model, 16)
    small = LLM(llm.model.checkpoint_dir, device=device, dtype="float64", max_num_batched_tokens=16, max_num_seqs=6,
                block_size=16, max_model_len=64, async_scheduling=async_scheduling,
                state_memory_bytes=6 * lay.bytes_per_slot() + 7 * lay.bytes_per_block())
    n = 20
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    steps = []
    small.engine.step_observers.append(lambda batch: steps.append([s.n for s in batch]))
    outs = small.generate(PROMPTS, sp, use_tqdm=False)
    stats = small.stats
    assert stats.preemptions > 0                      # the small pools forced recomputes
    assert all(sum(s) <= 16 and len(s) <= 6 for s in steps) and any(max(s) > 1 and len(s) > 1 for s in steps)
    assert stats.steps == len(steps) and stats.committed_tokens == n * len(PROMPTS)
    assert stats.requests_finished == len(PROMPTS) and stats.free_seats == stats.num_seats <= 6
    # every seat and block given back: free, or cached and unreferenced (prefix caching, on by default)
    assert stats.free_blocks + stats.prefix_cached_blocks == stats.num_blocks and stats.prefix_caching
    for prompt, out in zip(PROMPTS, outs):
        ids = llm.tokenizer.encode(prompt).ids
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == one_at_a_time(llm, ids, n), prompt
        assert out.outputs[0].finish_reason == "length" and out.finished
        m = out.metrics[0]
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert len(m.token_times) == n
    return small


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
    long = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    early = decode(long.token_ids[:2])
    stop = next(early[i:i + 1] for i in range(len(early)) if not early[i:i + 1].isspace())
    for min_tokens in (0, 4):
        s = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                                    min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        assert long.token_ids[:len(s.token_ids)] == s.token_ids
        before = len(decode(long.token_ids[:max(min_tokens - 1, 0)]))    # text no match may start in
        full = decode(s.token_ids)
        if s.finish_reason == "stop":
            assert s.stop_reason == stop and s.text == full[:len(s.text)] and full[len(s.text):].startswith(stop)
            assert min_tokens == 0 or len(s.token_ids) >= min_tokens
        else:
            assert s.finish_reason == "length" and s.text == full
        if min_tokens:
            assert len(s.text) >= before                   # a match inside the first min_tokens does not cut
        else:
            assert s.finish_reason == "stop" and len(s.token_ids) <= 2


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


@pytest.mark.parametrize("params, match", [
    (SamplingParams(stop_token_ids=[10**6], min_tokens=1), "stop_token_ids .* outside the vocabulary"),
    (SamplingParams(logprobs=21), "logprobs=21 exceeds the maximum 20"),
    (SamplingParams(prompt_logprobs=50), "prompt_logprobs=50 exceeds"),
])
def test_bad_sampling_params_for_this_model_fail_before_any_work(llm, params, match):
    with pytest.raises(DeepInferError, match=match):
        llm.generate(["fine", "also fine"], [SamplingParams(), params], use_tqdm=False)


def test_extreme_seeds_and_temperatures(llm):
    out = llm.generate("The cat", SamplingParams(seed=2**63 - 1, n=2, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(len(o.token_ids) == 3 for o in out.outputs)
    cold = llm.generate("The cat", SamplingParams(temperature=1e-30, max_tokens=4, ignore_eos=True), use_tqdm=False)
    greedy = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert cold[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, match", [
    ({"max_num_seq": 4}, "unknown arguments"), ({"max_num_seqs": 0}, "max_num_seqs=0"),
    ({"state_memory_bytes": -1}, "state_memory_bytes=-1"), ({"state_memory_bytes": "1e5"}, "state_memory_bytes"),
    ({"max_model_len": 0}, "max_model_len=0"), ({"seed": -1}, "seed=-1"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5"), ({"enforce_eager": "yes"}, "enforce_eager"),
    ({"async_scheduling": 1}, "async_scheduling=1"), ({"max_graph_batch": 0}, "max_graph_batch=0"),
    ({"state_memory_bytes": 1000}, "cannot hold one sequence of max_model_len"),
    ({"block_size": 3}, "block_size=3 must be a positive multiple of"),
    ({"device": "gpu"}, "device='gpu' is not a device"), ({"keep_quantized": "yes"}, "keep_quantized"),
    ({"max_num_batched_tokens": 4, "max_num_seqs": 8}, "max_num_batched_tokens=4 is below max_num_seqs=8"),
])
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(DeepInferError, match=match):
        LLM(embedded_tiny_dir("deepseek_v41"), **kwargs)


def test_chat_input_errors(llm):
    for bad in ("hello", [], [{"content": "no role"}]):
        with pytest.raises(DeepInferError, match="chat"):
            llm.chat(bad, use_tqdm=False)


@pytest.mark.usefixtures("transformers_v4_reference")
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
            assert abs(entry[tok].logprob - lp[j - 1, tok].item()) <= 1e-4
            row, val = lp[j - 1], lp[j - 1, tok]     # its rank in the reference distribution, up to the tolerance
            assert 1 + int((row > val + 1e-4).sum()) <= entry[tok].rank <= 1 + int((row > val - 1e-4).sum())


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


def test_state_pools_are_sized_from_the_budget_and_logged(caplog):
    import logging
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        small = LLM(embedded_tiny_dir("deepseek_v41"), max_model_len=256, max_num_seqs=8)
    from deepinfer.cache.pools import PoolLayout
    lay = PoolLayout.for_model(small.model, None)
    st = small.stats
    assert st.num_seats == 8 and st.num_blocks == 8 * lay.blocks_for(256) and st.block_tokens == lay.block_tokens
    assert "B/token" in caplog.text and "seats" in caplog.text and st.state_summary in caplog.text
    budget = lay.bytes_per_slot() * 3 + lay.bytes_per_block() * 5
    tight = LLM(embedded_tiny_dir("deepseek_v41"), max_model_len=256, max_num_seqs=8, state_memory_bytes=budget)
    t = tight.stats
    assert t.num_seats * lay.bytes_per_slot() + t.num_blocks * lay.bytes_per_block() <= budget
    assert t.num_blocks >= lay.blocks_for(256) and 1 <= t.num_seats < 8   # one full sequence fits; seats cut
    assert 0 < t.state_bytes <= budget


@pytest.mark.parametrize("name, value, match", [
    ("DEEPINFER_ASYNC_SCHEDULING", "maybe", "DEEPINFER_ASYNC_SCHEDULING='maybe' is not a flag; use 1 or 0"),
    ("DEEPINFER_ACCELERATOR", "tpu", "DEEPINFER_ACCELERATOR='tpu'"),
    ("DEEPINFER_BATCH_INVARIANT", "sometimes", "DEEPINFER_BATCH_INVARIANT='sometimes'"),
    ("DEEPINFER_YOCO_PREFILL_MIN_TOKENS", "0", "DEEPINFER_YOCO_PREFILL_MIN_TOKENS=0 must be >= 1"),
])
def test_bad_environment(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)                      # every LLM reads the environment when it is built
    with pytest.raises(DeepInferError, match=match):
        LLM(embedded_tiny_dir("deepseek_v41"))


@pytest.mark.parametrize("arch", ["deepseek_v41", "deepseek_v4"])
def test_batch_invariant_mode_seeded_sampling_is_bitwise_batch_independent(arch):
    """fp32, kernel_backend="invariant": a seeded request's tokens and logprobs are bitwise the same alone and
    inside batches of other compositions (chunked prefill pieces on fixed boundaries, decode rows reading
    every block column); with the engine's chunk boundaries fixed, a 16-token step budget cannot change them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)                # small tiled calls; spinning OpenMP threads only slow them down
    try:
        llm = LLM(embedded_tiny_dir(arch), max_model_len=96, max_num_batched_tokens=16, max_num_seqs=16,
                  kernel_backend="invariant")
        assert llm.batch_invariant and llm.stats.kernel_backend == "invariant"
        assert llm.stats.kernel_backends["linear"] == "invariant"
        sp = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=6, logprobs=2, ignore_eos=True)
        other = SamplingParams(temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
        target = PROMPTS[2]
        alone = llm.generate(target, sp, use_tqdm=False)[0].outputs[0]
        for mates in (PROMPTS[3:5], PROMPTS[5:11]):
            batch = mates[:1] + [target] + mates[1:]
            outs = llm.generate(batch, [other] + [sp] + [other] * (len(batch) - 2), use_tqdm=False)
            got = outs[1].outputs[0]
            assert got.token_ids == alone.token_ids
            assert got.logprobs == alone.logprobs           # float equality: bitwise
        ref = llm.with_kernel_backend("reference")          # a twin on the same model and pools
        assert not ref.batch_invariant and ref.model is llm.model and ref.engine.manager is llm.engine.manager
        steps = llm.stats.steps
        assert len(ref.generate(target, sp, use_tqdm=False)[0].outputs[0].token_ids) == 6
        assert ref.stats.kernel_backend == "reference" and ref.stats.steps > 0 and llm.stats.steps == steps
        assert llm.batch_invariant and llm.with_kernel_backend("invariant") is llm
    finally:
        torch.set_num_threads(before)


def test_prompt_logprobs_survive_one_token_pieces(llm):
    """A 2-token step budget shared with another sequence's decode feeds 1-token prompt pieces mid-prompt (which
    must still record their prompt logprobs): every prompt position gets its entry, equal to an unchunked run's."""
    sp = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1, ignore_eos=True)
    small = LLM(llm.model.checkpoint_dir, dtype="float64", max_num_batched_tokens=2, max_num_seqs=2)
    steps = []
    small.engine.step_observers.append(lambda batch: steps.append([(s.n, s.start) for s in batch]))
    chunked = small.generate([PROMPTS[1], PROMPTS[2]], sp, use_tqdm=False)
    assert any(len(st) == 2 and st[1] == (1, st[1][1]) and st[1][1] > 0 for st in steps)   # 1-token pieces
    for out in chunked:
        whole = llm.generate({"prompt_token_ids": out.prompt_token_ids}, sp, use_tqdm=False)[0]
        assert len(whole.prompt_logprobs) == len(whole.prompt_token_ids) == len(out.prompt_logprobs)
        for a, b in zip(whole.prompt_logprobs[1:], out.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[k].logprob - b[k].logprob) < 1e-9 for k in a)
        assert whole.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_in_row_blocks_equal_one_block(llm, monkeypatch):
    """The runner computes a long piece's prompt-logprob logits PROMPT_LOGPROB_ROWS rows at a time (a 128k prompt's
    fp32 logits would not fit at once): 3-row blocks give every entry of the one-block run, and the same tokens."""
    from deepinfer.runner import runner as runner_mod
    sp = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    whole = llm.generate(PROMPTS[2], sp, use_tqdm=False)[0]
    monkeypatch.setattr(runner_mod, "PROMPT_LOGPROB_ROWS", 3)
    blocked = llm.generate(PROMPTS[2], sp, use_tqdm=False)[0]
    assert len(whole.prompt_token_ids) > 6 and len(blocked.prompt_logprobs) == len(whole.prompt_logprobs)
    assert blocked.prompt_logprobs[0] is None
    for a, b in zip(whole.prompt_logprobs[1:], blocked.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[k].logprob - b[k].logprob) < 1e-9 and a[k].rank == b[k].rank
                                            for k in a)
    assert whole.outputs[0].token_ids == blocked.outputs[0].token_ids


def test_cuda_device_without_a_gpu_is_one_error_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(DeepInferError, match="no CUDA GPU is visible"):
        LLM(embedded_tiny_dir("deepseek_v41"), device="cuda")


def test_an_interrupted_run_gives_its_seats_back(llm):
    """An error or Ctrl-C inside a step must not leak slots and blocks: the next generate still runs."""
    free = llm.stats.free_seats, llm.stats.free_blocks
    calls = []

    def failing(batch):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
    llm.engine.step_observers.append(failing)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    finally:
        llm.engine.step_observers.remove(failing)
    assert (llm.stats.free_seats, llm.stats.free_blocks) == free and not llm.engine.has_unfinished()
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_stop_strings_ignore_text_before_min_tokens(llm):
    """A stop string already present in text produced before min_tokens does not end the sequence later."""
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    text = greedy[0].outputs[0].text
    ids = greedy[0].outputs[0].token_ids
    early = llm.tokenizer.decode(ids[:1], skip_special_tokens=True)
    stop = next((c for c in early if c.strip() and c not in text[len(early):]), None)
    if stop is None:
        pytest.skip("the first token's text repeats later")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=3, stop=[stop, "x" * 40])
    out = llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ids and out.finish_reason == "length"


def test_so_args_schema_that_does_not_compile_fails_before_any_work(llm):
    """A schema xgrammar refuses is one line naming the request, before any step (tests/test_structured_outputs.py
    has the rest)."""
    steps = llm.stats.steps
    with pytest.raises(DeepInferError) as err:
        llm.generate(["fine", "also fine"], [SamplingParams(), SamplingParams(so_args={"regex": "a+("})],
                     use_tqdm=False)
    assert str(err.value).startswith("request 1: so_args regex schema does not compile: ") and "\n" not in str(err.value)
    assert llm.stats.steps == steps and not llm.engine.has_unfinished()


def test_n_samples_and_logprobs_through_the_engine(llm):
    """n > 1 samples are separate sequences; every committed token has its logprob entry (sampled id + top-k)."""
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.9, seed=5, n=3, max_tokens=4, logprobs=2,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2] and len(out.metrics) == 3
    for o in out.outputs:
        assert len(o.logprobs) == len(o.token_ids) == 4
        assert all(t in e and len(e) <= 3 for t, e in zip(o.token_ids, o.logprobs))
        for t, e in zip(o.token_ids, o.logprobs):     # vLLM's Logprob: value, rank (1 = best), decoded text
            by_rank = {lp.rank: lp.logprob for lp in e.values()}
            assert {1, 2} <= set(by_rank) and by_rank[1] >= by_rank[2] >= e[t].logprob
            assert e[t].rank <= 2 or e[t].logprob < by_rank[2]
            assert all(lp.decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
                       for tok, lp in e.items())


def test_penalty_rows_count_the_token_in_flight_async_equals_sync(monkeypatch):
    """Repetition / frequency / presence penalties under asynchronous scheduling: each step counts the token still
    in flight on the device (the runner's in_flight counts), never reading the previous step before sampling;
    outputs equal synchronous scheduling bit for bit, and the penalties change what is drawn."""
    from deepinfer.runner import runner as runner_module
    build, in_flight_calls = runner_module.build_sampling_tensors, []

    def spy(*args, **kw):
        in_flight_calls.append(len(args) > 9 and args[9] is not None)
        return build(*args, **kw)
    monkeypatch.setattr(runner_module, "build_sampling_tensors", spy)
    kw = dict(max_tokens=20, ignore_eos=True)
    params = [SamplingParams(temperature=0.0, **kw), SamplingParams(temperature=0.0, repetition_penalty=1.8, **kw),
              SamplingParams(temperature=0.9, seed=3, frequency_penalty=1.5, **kw),
              SamplingParams(temperature=0.0, presence_penalty=-2.0, **kw)]
    prompts = ["z z z z", "z z z z", "Once upon a time", "z z z z"]     # the plain row first: penalty rows at 1..3
    outs, deferred, pending = {}, {}, {}
    for on in (True, False):
        llm = LLM(embedded_tiny_dir("deepseek_v41"), dtype="float64", async_scheduling=on)
        execute, calls = llm.engine.runner.execute, []

        def count(plan, prev, before_sample=None, ring_marks=None, execute=execute, calls=calls):
            calls.append(before_sample is not None)
            return execute(plan, prev, before_sample, ring_marks)
        llm.engine.runner.execute = count
        in_flight_calls.clear()
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        deferred[on], pending[on] = sum(calls), sum(in_flight_calls)
    assert outs[True] == outs[False]
    assert deferred[True] == deferred[False] == 0
    assert pending[True] >= 10 and pending[False] == 0
    assert outs[True][3] != outs[True][0]     # the same prompt: a negative presence penalty (repeats) against none
