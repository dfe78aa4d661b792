"""The lm-eval backend `deepinfer` against lm-eval's HF backend (transformers 5.23 DeepseekV4ForCausalLM) on the
same tiny V4 checkpoint: loglikelihoods (and rolling loglikelihoods) equal within 1e-4, the greedy flags equal;
generate_until honours stop sequences, max_gen_toks and seeds."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

TOL = 1e-4
PAIRS = [("Question: What is 12 + 7?\nAnswer:", " 19"), ("The river", " carried the morning light."),
         ("", "A quiet train watched the valley."), ("Which number is the largest? 4, 81, 7\nAnswer:", " 81"),
         ("x " * 300, "the end")]                       # a context longer than max_model_len: left-truncated
TEXTS = ["The north wind carried a red lantern without a sound. " * 12, "short"]


def _instances(kind, args):
    from lm_eval.api.instance import Instance
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


@pytest.fixture(scope="module")
def v4_hf_dir(tmp_path_factory):
    from deepinfer.checkpoint.make import make_checkpoint
    return make_checkpoint("deepseek_v4", "tiny", "hf", seed=3, out=tmp_path_factory.mktemp("v4hf") / "ck")


@pytest.fixture(scope="module")
def ours(v4_hf_dir):
    from deepinfer.evals.backend import DeepInferLM
    return DeepInferLM(pretrained=str(v4_hf_dir), max_model_len=256, max_num_seqs=4, qat_fake_quant=False)


@pytest.fixture(scope="module")
def reference(v4_hf_dir, transformers_v4_reference):
    from lm_eval.models.huggingface import HFLM
    return HFLM(pretrained=str(v4_hf_dir), dtype="float32", device="cpu", batch_size=4, max_length=254)


def test_tokenization_matches_hf_backend(ours, reference):
    for text in ("Question: What is 12 + 7?", "", "<｜begin▁of▁sentence｜>hello", TEXTS[0]):
        assert ours.tok_encode(text) == reference.tok_encode(text)
    assert ours.prefix_token_id == reference.prefix_token_id and ours.eot_token_id == reference.eot_token_id


def test_loglikelihood_matches_transformers(ours, reference):
    got = ours.loglikelihood(_instances("loglikelihood", PAIRS), disable_tqdm=True)
    want = reference.loglikelihood(_instances("loglikelihood", PAIRS), disable_tqdm=True)
    for (lp, greedy), (ref_lp, ref_greedy) in zip(got, want):
        assert math.isfinite(lp) and lp < 0
        assert abs(lp - ref_lp) <= TOL, (lp, ref_lp)
        assert greedy == ref_greedy


def test_loglikelihood_rolling_matches_transformers(ours, reference):
    got = ours.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in TEXTS]), disable_tqdm=True)
    want = reference.loglikelihood_rolling(_instances("loglikelihood_rolling", [(t,) for t in TEXTS]),
                                           disable_tqdm=True)
    for lp, ref_lp in zip(got, want):
        assert abs(lp - ref_lp) <= TOL * max(1.0, abs(ref_lp) / 100), (lp, ref_lp)


def test_greedy_flag_is_the_argmax(ours):
    """A continuation built from the model's own greedy tokens is greedy; changing its last token is not."""
    ctx = ours.tok_encode("The old clock")
    out = ours.llm.generate([{"prompt_token_ids": ctx}], __import__("deepinfer").SamplingParams(
        max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    other = (out[-1] + 1) % ours.llm.model.cfg.vocab_size
    (lp, greedy), (lp2, greedy2) = ours.score_continuations([(ctx, out), (ctx, out[:-1] + [other])])
    assert greedy and not greedy2 and lp > lp2


def test_generate_until_stops_and_seeds(ours):
    def gen(kwargs):
        return ours.generate_until(_instances("generate_until", [("Question: What is 2 + 2?\nAnswer:", kwargs)]),
                                   disable_tqdm=True)[0]
    text = gen({"until": ["\n"], "max_gen_toks": 12, "do_sample": False})
    assert "\n" not in text and isinstance(text, str)
    # max_gen_toks: the reply is the decoded first 3 greedy tokens
    from deepinfer import SamplingParams
    ids = ours.llm.generate([{"prompt_token_ids": ours.tok_encode("Question: What is 2 + 2?\nAnswer:")}],
                            SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    eos = ours.tokenizer.decode([ours.eot_token_id], skip_special_tokens=False)
    want = ours.tokenizer.decode(ids[:3], skip_special_tokens=True)
    assert gen({"until": [], "max_gen_toks": 3, "do_sample": False}) == want.split(eos)[0]
    # a stop sequence taken from the greedy reply itself cuts it there
    full = gen({"until": [], "max_gen_toks": 12, "do_sample": False})
    assert len(full) > 3, full
    assert gen({"until": [full[2:4]], "max_gen_toks": 12, "do_sample": False}) == full[:full.index(full[2:4])]
    sampled = {"until": [], "max_gen_toks": 8, "do_sample": True, "temperature": 1.0}
    assert gen(sampled) == gen(sampled)                 # seed from (backend seed, task, doc, index)
    greedy8 = gen({"until": [], "max_gen_toks": 8, "do_sample": False})
    draws = ours.generate_until(_instances("generate_until", [("Question: What is 2 + 2?\nAnswer:", sampled)] * 4),
                                disable_tqdm=True)
    assert len(set(draws) | {greedy8}) > 1             # sampling really samples: four seeds, not all greedy


def test_bad_requests(ours):
    from deepinfer.errors import DeepInferError
    with pytest.raises(DeepInferError, match=r"max_gen_toks=254 must be below max_length=254 \(max_model_len - 2\)"):
        ours.generate_until(_instances("generate_until", [("hi", {"max_gen_toks": 254})]), disable_tqdm=True)
    with pytest.raises(DeepInferError, match=r"generation settings \['num_beams'\] are not supported"):
        ours.generate_until(_instances("generate_until", [("hi", {"max_gen_toks": 4, "num_beams": 2})]),
                            disable_tqdm=True)
    with pytest.raises(DeepInferError, match="does not fit max_model_len=256"):
        ours.score_continuations([([1], list(range(2, 300)))])
    with pytest.raises(DeepInferError, match="concurrency=9 must be in 1..max_num_seqs"):
        type(ours)(llm=ours.llm, concurrency=9)
