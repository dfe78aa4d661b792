"""Verify rows end to end on the real runner: an engine fed draft tokens (some right, some wrong) commits
exactly the tokens greedy decoding gives, rolls its state back after each rejection (snapshot / restore of
the rings, the rest fed again) and says so in its statistics. float64, both families. The drafts and the
verdicts are hand-made runner outputs: the real runner runs the verify rows (it has no drafter), and each step's
output is given the drafts accepted and the next drafts, as a drafting runner returns them."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.speculative.speculation import Speculation

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "12 + 30 =", "x"]
N = 24


# Penalties that reward repeats, so the greedy tokens depend on the output counts (a tiny random model rarely
# repeats on its own, and then a repeat penalty changes nothing).
PENALTIES = {"frequency_penalty": -1.0, "repetition_penalty": 0.5}


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
@pytest.mark.parametrize("async_scheduling,penalties", [(True, False), (False, False), (True, True)])
def test_drafts_commit_greedy_tokens_and_roll_back(arch, async_scheduling, penalties):
    """With penalties, each logit position of a verify row counts the drafts before it as outputs."""
    llm = LLM(embedded_tiny_dir(arch), dtype="float64", async_scheduling=async_scheduling)
    greedy = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, **(PENALTIES if penalties else {}))
    llm.engine.reset_stats()
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    plain_steps = llm.stats.steps
    want = [o.outputs[0].token_ids for o in outs]
    truth = {tuple(o.prompt_token_ids): w for o, w in zip(outs, want)}
    vocab = llm.model.cfg.vocab_size
    proposals = []

    def drafter(prompt, num_outputs):
        """3 drafts: the true next tokens, with the second one wrong on every other call."""
        out = truth[tuple(prompt)]
        drafts = list(out[num_outputs:num_outputs + 3])
        if len(proposals) % 2 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % vocab
        proposals.append(len(drafts))
        return drafts

    execute = llm.engine.runner.execute

    def verifying(plan, prev, before_sample=None, ring_marks=None):
        """The step, its output given each sampled row's verdict: drafts accepted while they equal the samples, and
        the next drafts after what the row commits."""
        out = execute(plan, prev, before_sample, ring_marks)
        verdicts = []
        for row, toks, _ in out.resolve():
            accepted = 0
            while accepted < len(row.draft_ids) and toks[accepted] == row.draft_ids[accepted]:
                accepted += 1
            drafts = drafter(row.prompt_ids, len(row.output_ids) + accepted + 1)
            verdicts.append((accepted, drafts, [1.0] * len(drafts)))
        out.speculation = lambda: verdicts
        return out

    llm.engine.runner.execute = verifying
    llm.engine.speculation = Speculation(None, llm.max_model_len)
    llm.engine.reset_stats()
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    st = llm.stats
    assert got == want
    assert st.draft_tokens > st.accepted_draft_tokens > 0 and st.rollbacks > 0
    assert st.steps < plain_steps                       # multi-token commits: fewer steps than one token a step
    assert st.free_seats == st.num_seats               # every seat back
