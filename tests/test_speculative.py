"""Speculative decoding end to end on the real runner (tiny V4.1 with DSpark, tiny V4 with its MTP layer; CPU):
greedy output equals plain decoding token for token under every verify schedule, with chunked prefill and
preemption in between and with forced partial acceptances and full rejections; the state every kind holds after
rollbacks is the one plain decoding leaves; V4's pooled MTP drafts are the reference layer's k-step chain;
grammar-constrained requests verify drafts under their grammar; seeded sampling is bitwise batch-invariant (and
equal to plain decoding) in batch-invariant mode; the pinned acceptance model reproduces its accepted length;
bad settings are one line each."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.errors import DeepInferError
from deepinfer.reference import forward_reference, mtp_forward, new_state

PROMPTS = ["The quick brown fox", "Once upon a time in a land far away, there lived", "12 + 30 =", "x",
           "hello world again and again", "a b c d e f g", "DeepSeek", "what is the answer to 6 times 7?"]
N = 20
TABLE = {1: 1.0, 8: 1.02, 32: 1.2, 128: 2.0}          # seconds per step: cheap extra tokens, then costly
V41, V4 = "deepseek_v41", "deepseek_v4"


def engine(arch: str = V41, **kw) -> LLM:
    """A tiny model in float64 (V4.1 unless told), its state pools capped (the default budget is 2 GiB a float64
    engine; a test holds several engines at once on CI's machine)."""
    kw.setdefault("state_memory_bytes", 1 << 27)
    return LLM(embedded_tiny_dir(arch), dtype="float64", **kw)


def spec_of(schedule: str, **extra) -> dict:
    """A speculative setting: the step-rate table only where the schedule reads one."""
    return {"schedule": schedule, **({} if schedule == "fixed" else {"step_seconds": TABLE}), **extra}


def force_drafts(llm: LLM, truth: dict[tuple, list[int]], wrong, confidence=None) -> dict:
    """Make the model's drafter propose the plain run's tokens (truth: prompt ids -> outputs), with draft k of a
    block at position p made wrong when wrong(p, k): partial acceptances and full rejections on demand. The real
    draft block still runs (its kernels, its ring reads); only the proposed ids are replaced, and with
    confidence(p, k) -> [0, 1] the confidences of V4's MTP drafts (random weights give them ~1/vocab)."""
    real, core, seen = llm.model.draft, llm.engine, {"blocks": 0}
    vocab = llm.model.cfg.vocab_size

    def draft(pools, slots, positions, tokens, sample, steps):
        out = real(pools, slots, positions, tokens, sample, steps)
        by_slot = {core.manager.slot(r.request_id): r for r in core.scheduler.running}
        toks = out.tokens.clone()
        for i, (slot, p) in enumerate(zip(slots.tolist(), positions.tolist())):
            r = by_slot[slot]
            stream = r.prompt_ids + truth[tuple(r.prompt_ids)]
            for k in range(toks.shape[1]):
                at = p + 2 + k                          # draft k of the block anchored at p is for position p+2+k
                t = stream[at] if at < len(stream) else 0
                toks[i, k] = (t + 1) % vocab if wrong(at, k) else t
                if confidence is not None:
                    out.confidence[i, k] = confidence(at, k)
            seen["blocks"] += 1
        out.tokens = toks
        return out

    llm.model.draft = draft
    return seen


@pytest.mark.parametrize("arch,schedule", [(V41, "fixed"), (V41, "confidence"), (V41, "budget"), (V4, "fixed"),
                                           (V4, "budget"), (V41, "confidence+padding")])
def test_greedy_speculation_equals_plain_decoding_with_chunks_and_preemption(arch, schedule):
    """8 prompts, a 16-token step budget (chunked prefill next to verify rows), pools small enough to preempt;
    drafts right except where (position + k) % 4 == 3 or at position % 7 == 0 for the first draft (a full
    rejection): every output equals plain greedy decoding, and drafts were accepted and rejected. `+padding`:
    steps padded up the graphs' row ladder (as CUDA graphs run them), the padding filled with drafts."""
    from deepinfer.cache.pools import PoolLayout
    from deepinfer.runner.graphs import row_ladder
    schedule, padded = schedule.split("+")[0], schedule.endswith("+padding")
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    first = engine(arch)
    want = [o.outputs[0] for o in first.generate(PROMPTS, sp, use_tqdm=False)]
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids
             for o in first.generate(PROMPTS, sp, use_tqdm=False)}
    probe = engine(arch, speculative=spec_of(schedule))
    lay = PoolLayout.for_model(probe.model, 16, ring_slack=5)
    small = dict(max_num_batched_tokens=16, max_num_seqs=6, block_size=16, max_model_len=64,
                 state_memory_bytes=6 * lay.bytes_per_slot() + 7 * lay.bytes_per_block())
    plain = engine(arch, **small)
    plain.generate(PROMPTS, sp, use_tqdm=False)
    llm = engine(arch, speculative=spec_of(schedule), **small)
    seen = force_drafts(llm, truth, lambda at, k: (at + k) % 4 == 3 or (k == 0 and at % 7 == 0),
                        None if arch == V41 else lambda at, k: 0.95 if (at + k) % 5 else 0.3)
    if padded:
        llm.engine.speculation.policy.pad = lambda segments, rows: row_ladder(rows)
    got = llm.generate(PROMPTS, sp, use_tqdm=False)
    st = llm.stats
    if padded:
        assert llm.engine.speculation.policy.filled > 0
    assert [o.outputs[0].token_ids for o in got] == [w.token_ids for w in want]
    assert st.preemptions > 0 and seen["blocks"] > 0
    assert st.draft_tokens > st.accepted_draft_tokens > 0 and st.rollbacks > 0
    assert st.committed_tokens == N * len(PROMPTS) and st.free_seats == st.num_seats
    assert st.steps < plain.stats.steps              # multi-token commits: fewer steps than plain decoding


def live_state(llm: LLM, slot: int, n: int, lagging: tuple = ()) -> dict[str, torch.Tensor]:
    """What the model can read of slot `slot` holding positions 0..n-1: each ring's last `span` positions (by
    position, whatever slack the ring has), each entry stream's n // ratio entries. Rings in `lagging` end one
    position earlier (V4's MTP window: the target's steps write position t-1 from the token at t; drafts write n-1)."""
    pools = llm.engine.manager.pools
    out = {}
    for name, ring in pools.rings.items():
        span, end = pools.spans[name], n - 1 if name in lagging else n
        pos = torch.arange(max(0, end - span), end)
        out[name] = ring[slot, pos % ring.shape[1]]
    for kind in pools.layout.spec.entries:
        store = pools.entries[kind.name]
        j = torch.arange(n // kind.ratio)
        blocks = pools.block_table[slot, (j * kind.ratio) // pools.block_tokens].long()
        out[kind.name] = store[blocks, j % store.shape[1]]
    return out


@pytest.mark.parametrize("arch", [V41, V4])
def test_every_state_kind_after_rollbacks_is_what_plain_decoding_leaves(arch):
    """One sequence through many verify rows with rejections: the window rings, compressor rings, engram look-back,
    entry streams (KV and indexer keys) and draft rings (DSpark's; V4's MTP window and last streams) hold, at every
    position the model can still read, what plain decoding (writing the draft rings too) leaves, to float64
    rounding of other row shapes."""
    sp = SamplingParams(temperature=0, max_tokens=3 * N, ignore_eos=True)
    prompt = PROMPTS[1]
    plain = engine(arch)
    plain.engine.runner.keep_draft_rings = True           # so the draft rings are comparable
    want = plain.generate(prompt, sp, use_tqdm=False)[0]
    spec = engine(arch, speculative={"schedule": "budget" if arch == V4 else "confidence", "step_seconds": TABLE})
    force_drafts(spec, {tuple(want.prompt_token_ids): want.outputs[0].token_ids},
                 lambda at, k: (at * 7 + k) % 5 == 2)
    got = spec.generate(prompt, sp, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert spec.stats.rollbacks > 3 and spec.stats.accepted_draft_tokens > 10
    n = len(want.prompt_token_ids) + 3 * N - 1             # positions both fed (the last token is never fed)
    lagging = ("mtp.0.window",) if arch == V4 else ()
    a, b = live_state(plain, 1, n, lagging), live_state(spec, 1, n, lagging)
    assert set(a) == set(b) and any(k.startswith("mtp.") for k in a) and any("index" in k for k in a)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert (a[name].double() - b[name].double()).abs().max().item() <= 1e-12, name


def test_seeded_speculation_is_bitwise_batch_invariant_in_invariant_mode():
    """kernel_backend="invariant", a seed, DSpark on with confidence-scheduled verification (whose verify lengths
    depend on the batch): tokens and logprobs are bitwise those of plain decoding, alone and in batches of other
    compositions (drafts forced right on most positions, so verify rows accept and reject)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = dict(max_model_len=96, max_num_batched_tokens=32, max_num_seqs=16, kernel_backend="invariant")
        sp = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, logprobs=2, ignore_eos=True)
        other = SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True)
        target = PROMPTS[2]
        plain = LLM(embedded_tiny_dir(V41), **kw)
        alone_plain = plain.generate(target, sp, use_tqdm=False)[0]
        mates = [plain.generate(p, other, use_tqdm=False)[0] for p in PROMPTS[3:8]]
        truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in [alone_plain, *mates]}
        spec = LLM(embedded_tiny_dir(V41), speculative={"schedule": "confidence", "step_seconds": TABLE}, **kw)
        force_drafts(spec, truth, lambda at, k: (at + 2 * k) % 5 == 1)
        assert spec.engine.runner.speculator.rule == "coupled"
        alone = spec.generate(target, sp, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == alone_plain.outputs[0].token_ids
        assert alone.logprobs == alone_plain.outputs[0].logprobs
        for k in (1, 3, 5):
            batch = PROMPTS[3:3 + k][:1] + [target] + PROMPTS[3:3 + k][1:]
            outs = spec.generate(batch, [other] + [sp] + [other] * (len(batch) - 2), use_tqdm=False)
            assert outs[1].outputs[0].token_ids == alone.token_ids
            assert outs[1].outputs[0].logprobs == alone.logprobs        # float equality: bitwise
        assert spec.stats.accepted_draft_tokens > 0 and spec.stats.rollbacks > 0
    finally:
        torch.set_num_threads(before)


def test_pinned_acceptance_gives_its_accepted_length():
    """speculative acceptance = survival rates: with fixed 5-token verification the mean accepted length (bonus
    included) over many verify rows is 1 + sum of the rates (3.51 for V4.1-Flash's golden curve)."""
    survival = [0.788, 0.632, 0.485, 0.321, 0.284]
    llm = engine(speculative={"schedule": "fixed", "acceptance": survival})
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    llm.generate(PROMPTS, sp, use_tqdm=False)
    st = llm.stats
    rows = st.draft_tokens / 5
    mean = 1 + st.accepted_draft_tokens / rows
    assert rows > 250
    assert abs(mean - (1 + sum(survival))) < 0.15, mean


def test_confidence_schedule_verifies_fewer_tokens_at_similar_acceptance():
    """With the pinned model (spread confidences), confidence scheduling on a table where extra tokens cost verifies
    fewer drafts per accepted one than fixed 5-token verification."""
    survival = [0.788, 0.632, 0.485, 0.321, 0.284]
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    stats = {}
    for schedule in ("fixed", "confidence"):
        table = {} if schedule == "fixed" else {"step_seconds": {1: 1.0, 8: 1.3, 64: 3.0}}
        llm = engine(speculative={"schedule": schedule, "acceptance": survival, **table})
        llm.generate(PROMPTS, sp, use_tqdm=False)
        stats[schedule] = llm.stats
    fixed, conf = stats["fixed"], stats["confidence"]
    assert conf.draft_tokens < 0.8 * fixed.draft_tokens
    assert conf.accepted_draft_tokens / conf.draft_tokens > fixed.accepted_draft_tokens / fixed.draft_tokens


def test_v4_pooled_mtp_drafts_are_the_reference_layers_k_step_chain():
    """V4 drafts with its MTP layer, 5 steps reusing it: at every draft block of a run with forced partial
    acceptances and rejections (chunked prefill too), the pooled drafts and confidences equal the reference chain
    (models/deepseek_v4.mtp_forward over the accepted prefix, then fed its own streams and drafts) in float64."""
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    prompts = PROMPTS[:4]
    plain = engine(V4)
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)}
    llm = engine(V4, speculative=True, max_num_batched_tokens=16, max_num_seqs=4)
    model, blocks = llm.model, []
    real = model.draft

    def record(pools, slots, positions, tokens, sample, steps):
        out = real(pools, slots, positions, tokens, sample, steps)
        by_slot = {llm.engine.manager.slot(q.request_id): q for q in llm.engine.scheduler.running}
        streams = [by_slot[x].prompt_ids + truth[tuple(by_slot[x].prompt_ids)] for x in slots.tolist()]
        blocks.append((positions.tolist(), tokens.tolist(), out.tokens.clone(), out.confidence.clone(), streams))
        return out

    model.draft = record
    force_drafts(llm, truth, lambda at, k: (at + k) % 3 == 2)
    llm.generate(prompts, sp, use_tqdm=False)
    assert llm.stats.accepted_draft_tokens > 0 and llm.stats.rollbacks > 0
    checked = 0
    for positions, tokens, drafts, conf, stream_of in blocks[::2]:
        for r, (p, y) in enumerate(zip(positions, tokens)):
            stream = stream_of[r]
            assert stream[p + 1] == y                     # the anchor token is the committed one
            ids, state = torch.tensor(stream[:p + 1]), new_state(model)
            with torch.inference_mode():
                streams = forward_reference(model, ids, [(0, p + 1)], [state])
                if p:
                    mtp_forward(model, streams[:p], ids[1:], [(0, p)], [state])
                h, tok = streams[p:], torch.tensor([y])
                for k in range(drafts.shape[1]):
                    logits, h = mtp_forward(model, h, tok, [(0, 1)], [state])
                    tok = logits.argmax(dim=-1)
                    assert int(tok) == int(drafts[r, k]), (p, k)
                    want = torch.softmax(logits, dim=-1)[0, tok].item()
                    assert abs(want - conf[r, k].item()) <= 1e-9 * max(want, 1e-30) + 1e-300, (p, k)
            checked += 1
    assert checked > 10


GRAMMAR = r"(cat|dog)s? [0-9]{1,3}( and (cat|dog)s?)?( with [a-z]{2,6})?"


@pytest.mark.parametrize("arch", [V41, V4])
def test_constrained_requests_verify_drafts_under_their_grammar(arch):
    """so_args with speculation: greedy regex-constrained output equals plain constrained decoding token for token
    with drafts forced right except where (position + k) % 4 == 3 (a wrong id, often one the grammar refuses: cut
    before verification); every output ends with "stop" and matches; seeded sampled constrained rows are bitwise
    those of plain decoding in batch-invariant mode (the coupled rule; wrong drafts the grammar allows are
    rejected); a pinned acceptance model with so_args is refused."""
    import re
    pytest.importorskip("xgrammar")
    so = {"regex": GRAMMAR}
    greedy = SamplingParams(temperature=0, max_tokens=40, so_args=so)
    prompts = PROMPTS[:4]
    plain = engine(arch)
    want = plain.generate(prompts, greedy, use_tqdm=False)
    truth = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in want}
    llm = engine(arch, speculative=True)
    seen = force_drafts(llm, truth, lambda at, k: (at + k) % 4 == 3)
    got = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [w.outputs[0].token_ids for w in want]
    for o in got:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(GRAMMAR, o.outputs[0].text), o.outputs[0]
    st = llm.stats
    assert 0 < st.accepted_draft_tokens and st.draft_tokens < 5 * seen["blocks"]       # refused drafts were cut
    kw = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=8, kernel_backend="invariant")
    sampled = [SamplingParams(temperature=0.8, seed=s, max_tokens=40, so_args=so) for s in range(4)]
    base = LLM(embedded_tiny_dir(arch), **kw).generate(prompts, sampled, use_tqdm=False)
    spec = LLM(embedded_tiny_dir(arch), speculative={"schedule": "budget", "step_seconds": TABLE}, **kw)
    force_drafts(spec, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in base},
                 lambda at, k: (at + 2 * k) % 5 == 1, None if arch == V41 else lambda at, k: 0.9)
    outs = spec.generate(prompts, sampled, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert spec.stats.accepted_draft_tokens > 0 and spec.stats.rollbacks > 0    # legal wrong drafts rejected
    pinned = engine(arch, speculative={"acceptance": [0.5] * 5})
    with pytest.raises(DeepInferError, match="so_args with a pinned speculative acceptance model"):
        pinned.generate("x", greedy, use_tqdm=False)


@pytest.mark.parametrize("value,match", [
    ({"method": "eagle"}, "method='eagle' is not supported"),
    ({"num_speculative_tokens": 9}, "must be an integer in 1..5"),
    ({"schedule": "smart"}, "schedule='smart'"),
    ({"acceptance": [0.5, 0.7, 0.1, 0.1, 0.1]}, "non-increasing"),
    ({"acceptance": [0.5]}, "one survival rate per draft"),
    ({"schedule": "confidence", "step_seconds": {0: 1.0}}, "step_seconds"),
    ({"step_seconds": {1: 1.0}}, "schedule 'fixed' verifies every draft and reads none"),
    ({"confidence_spread": 0.5}, "give acceptance too"),
    ({"acceptance": [0.5] * 5, "confidence_spread": 2}, r"must be a number in \[0, 1\]"),
    ({"speed": 1}, "unknown keys"),
    ("yes", "speculative='yes'"),
])
def test_bad_speculative_settings_are_one_line(value, match):
    with pytest.raises(DeepInferError, match=match) as info:
        engine(speculative=value)
    assert "\n" not in str(info.value)


def test_speculation_runs_the_synchronous_loop():
    """Verify steps read each step's commits before planning the next: async_scheduling is off (stats say so),
    and asking for it together with speculation is one line."""
    assert engine(speculative=True).stats.async_scheduling is False
    with pytest.raises(DeepInferError, match="async_scheduling=True with speculative decoding"):
        engine(speculative=True, async_scheduling=True)


def test_sampled_rows_with_logprobs_under_the_lossless_rule():
    """Sampled rows that ask for logprobs, drafts rejected and accepted: every committed token has its logprob
    entry (the rows after a rejection hold plain samples, never an invalid id)."""
    llm = engine(speculative=True)
    sp = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, logprobs=2, seed=3)
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 12 and len(c.logprobs) == 12
        assert all(t in entry for t, entry in zip(c.token_ids, c.logprobs))
    assert llm.stats.draft_tokens > 0 and llm.stats.rollbacks > 0


def test_speculation_needs_a_drafter_of_the_models_method_and_env_switches(monkeypatch):
    import dataclasses
    from deepinfer.config.presets import TINY_V4
    from deepinfer.models import build_model
    no_nextn = build_model(dataclasses.replace(TINY_V4, num_nextn_predict_layers=0), "cpu", torch.float32)
    no_nextn.checkpoint_dir = embedded_tiny_dir(V4)           # its tokenizer
    with pytest.raises(DeepInferError, match="needs a model that drafts"):
        LLM(model=no_nextn, speculative=True)
    with pytest.raises(DeepInferError, match="this model drafts with 'mtp'"):
        engine(V4, speculative="dspark")
    with pytest.raises(DeepInferError, match="this model drafts with 'dspark'"):
        engine(speculative={"method": "mtp"})
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    llm = engine(speculative=None, max_num_seqs=4)             # a short step-rate profile (up to 16 tokens)
    assert llm.speculative.num_speculative_tokens == 3 and llm.speculative.schedule == "confidence"
    assert llm.engine.speculation.policy.rate is not None           # profiled at start: a table of step seconds
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    with pytest.raises(DeepInferError, match="DEEPINFER_ENABLE_MTP_VARLEN=1 schedules speculative verification"):
        engine()
    with pytest.raises(DeepInferError, match="speculative=False turns speculative decoding off, but "
                                             "DEEPINFER_ENABLE_MTP_VARLEN=1 ask"):
        engine(speculative=False)                                # the switch would go unapplied: refused
    monkeypatch.delenv("DEEPINFER_ENABLE_MTP_VARLEN")
    assert engine().speculative is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch,schedule", [(V41, "fixed"), (V41, "confidence"), (V4, "budget")])
def test_cuda_graph_speculation_equals_eager(arch, schedule):
    """On the GPU (float64), verify steps of one length and of many (the confidence schedule) and the draft
    blocks replay from CUDA graphs and commit what the eager engine commits, with the pinned acceptance model
    (so partial acceptances and rollbacks happen) and greedy forced-right drafts."""
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    spec = spec_of(schedule, acceptance=[0.8, 0.6, 0.45, 0.3, 0.25])
    outs, stats, pad = {}, {}, None
    for eager in (False, True):
        llm = LLM(embedded_tiny_dir(arch), dtype="float64", device="cuda", enforce_eager=eager, speculative=spec)
        if eager:                       # the same verify lengths: the graphed engine fills its graphs' padding
            llm.engine.speculation.policy.pad = pad
        else:
            pad = llm.engine.speculation.policy.pad
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        stats[eager] = (llm.stats, llm.engine.speculation.policy.filled)
    assert outs[True] == outs[False]
    graphed, filled = stats[False]
    assert graphed.graph_replays > 0 and graphed.rollbacks > 0
    assert stats[True][0].accepted_draft_tokens == graphed.accepted_draft_tokens and stats[True][1] == filled
    if schedule != "fixed":             # a variable-length graph: (size, q=None, rows, ...) keys
        assert any(k[1] is None for k in graphed.graphs_captured), graphed.graphs_captured
    if schedule == "confidence":        # its table stops short of every draft: the padding verified some
        assert filled > 0


def test_lossless_sampling_follows_the_target_distribution_end_to_end():
    """Seeded top-2 sampling (at a temperature that splits every position's top 2 at most 70 / 30) with DSpark drafting
    through the lossless rule. The drafter's first draft distribution is replaced (through the real block's sample
    hook, so the kept draft distributions are the ones drawn from) by one that puts 0.8 on the target's *less*
    likely id: accepting it without the ratio test would skew the output. The joint distribution of the first two
    output tokens (the second one verified) over 600 seeds fits the target's, computed exactly from the plain
    engine's logprobs (chi-square, p > 1e-3, cells expected below 5 pooled); drafts are both accepted and rejected."""
    import math
    prompt = [7, 11, 13, 17, 19]
    k, n = 2, 600

    def top(llm, ids):                    # the target's top-k ids and their logprobs
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=k),
                           use_tqdm=False)[0].outputs[0]
        entry = out.logprobs[0]
        ids_ = sorted(entry, key=lambda t: entry[t].rank)[:k]
        return ids_, torch.tensor([entry[t].logprob for t in ids_], dtype=torch.float64)

    plain = engine()
    first, lp1 = top(plain, prompt)
    seconds = {a: top(plain, prompt + [a]) for a in first}
    # a temperature at which every position's top-2 split is at most 70 / 30 (a weight-independent test: the
    # random model's logit gaps set it), so both ids of every cell are drawn often enough to be tested
    gaps = [float(lp[0] - lp[1]) for lp in [lp1, *(lp for _, lp in seconds.values())]]
    temperature = max(max(gaps) / math.log(7 / 3), 1e-3)
    p1 = torch.softmax(lp1 / temperature, 0)
    cells, expected, unlikely = [], [], {}
    for a, pa in zip(first, p1.tolist()):
        second, lp2 = seconds[a]
        p2 = torch.softmax(lp2 / temperature, 0)
        unlikely[a] = second[int(p2.argmin())]
        for b, pb in zip(second, p2.tolist()):
            cells.append((a, b))
            expected.append(pa * pb * n)
    llm = engine(speculative={"schedule": "fixed"})
    real = llm.model.draft

    def draft(pools, slots, positions, tokens, sample, steps):
        anchors = tokens.tolist()

        def skewed(i, logits):
            if i == 0:
                custom = torch.full_like(logits, float("-inf"))
                for r, a in enumerate(anchors):
                    if a in unlikely:
                        pair = [b for x, b in cells if x == a]
                        for b in pair:
                            custom[r, b] = temperature * math.log(0.8 if b == unlikely[a] else 0.2)
                    else:
                        custom[r] = logits[r]
                logits = custom
            return sample(i, logits)
        return real(pools, slots, positions, tokens, skewed, steps)

    llm.model.draft = draft
    sps = [SamplingParams(temperature=temperature, top_k=k, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sps, use_tqdm=False)
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]
    assert set(pairs) <= set(cells), set(pairs) - set(cells)
    observed = [pairs.count(c) for c in cells]
    big = [i for i, e in enumerate(expected) if e >= 5]            # cells expected below 5 are pooled into one
    obs = [observed[i] for i in big] + [sum(o for i, o in enumerate(observed) if i not in big)]
    exp = [expected[i] for i in big] + [sum(e for i, e in enumerate(expected) if i not in big)]
    if exp[-1] < 5:                                                # too little pooled mass: fold it into a cell
        obs, exp = obs[:-2] + [obs[-2] + obs[-1]], exp[:-2] + [exp[-2] + exp[-1]]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    critical = {1: 10.828, 2: 13.816, 3: 16.266}[len(obs) - 1]      # chi-square at p = 1e-3
    assert stat < critical, (observed, [round(e, 1) for e in expected])
    st = llm.stats
    assert st.draft_tokens > 0 and 0 < st.accepted_draft_tokens < st.draft_tokens    # both paths taken
