"""FP8 KV records read in place by the Triton kernels on a CUDA device (`-m gpu`), at released widths in bf16: the
attention over a packed window ring (SplitStore beside this step's rows) and packed entries, and the indexer over
packed keys, against the fp32 reference on the same stores (the attention bound, 1e-2 of max) and against the
same kernels over the unpacked bf16 stores (the decoded tiles hold the same values; the compiled code differs,
so the outputs may differ in summation order: printed, bounded by the same 1e-2); whole tiny engines with
kv_cache_dtype="fp8" give the model-dtype cache's tokens and logprobs bit for bit on the reference set."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import attention as ka
from deepinfer.kernels import attention_triton as kat
from deepinfer.kernels import indexer_triton as kit
from deepinfer.kernels.kv_formats import INDEX_KEY, V4_LATENT, V41_ENTRY, V41_WINDOW, PackedStore

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def packed(fmt, n, g):
    x = torch.randn(n, fmt.width, device=DEV, generator=g)
    store = PackedStore(fmt.pack(x), fmt, torch.bfloat16)
    return store, store[torch.arange(n, device=DEV)]              # the records, and the same values unpacked


@pytest.mark.parametrize("family", ["v4", "v41"])
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
@pytest.mark.parametrize("backend", ["triton", "triton_invariant"])
def test_attention_over_packed_stores_matches_the_unpacked(family, rows, backend):
    g = torch.Generator(device=DEV).manual_seed(rows)
    wfmt, efmt = (V4_LATENT, V4_LATENT) if family == "v4" else (V41_WINDOW, V41_ENTRY)
    ring, ring_plain = packed(wfmt, 260 * 128, g)
    entries, entries_plain = packed(efmt, 8192, g)
    new = torch.randn(rows, 512, device=DEV, generator=g).to(torch.bfloat16)
    w_index = torch.randint(0, ring.shape[0] + rows, (rows, 128), device=DEV, generator=g)
    e_index = torch.randint(-1, 8192, (rows, 512), device=DEV, generator=g)
    q = torch.randn(rows, 64, 512, device=DEV, generator=g).to(torch.bfloat16)
    sink = torch.randn(64, device=DEV, generator=g)
    fn = kat.sparse_sink_attention_triton if backend == "triton" else kat.sparse_sink_attention_triton_invariant
    sources = [(ka.SplitStore(ring, new), w_index), (entries, e_index)]
    assert kat.supported(q, sources)
    got = fn(q, sources, sink, 512 ** -0.5)
    plain = fn(q, [(ka.SplitStore(ring_plain, new), w_index), (entries_plain, e_index)], sink, 512 ** -0.5)
    want = ka._sparse_sink_attention(q, sources, sink, 512 ** -0.5)
    scale = float(want.float().abs().max())
    err, vs_plain = (float((got.float() - w.float()).abs().max()) / scale for w in (want, plain))
    print(f"attention {family} {backend} rows {rows}: vs reference {err:.2e}, vs unpacked stores {vs_plain:.2e}, "
          f"bitwise {torch.equal(got, plain)}")
    assert err <= 1e-2 and vs_plain <= 1e-2


@pytest.mark.parametrize("heads", [64, 32])
def test_indexer_over_packed_keys_matches_the_unpacked(heads):
    g = torch.Generator(device=DEV).manual_seed(heads)
    keys, keys_plain = packed(INDEX_KEY, 20000, g)
    index = torch.randint(-1, 20000, (64, 4096), device=DEV, generator=g)
    q = torch.randn(64, heads, 128, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(64, heads, device=DEV, generator=g)
    got = kit.index_scores_kernel(q, w, keys, index, 128 ** -0.5)
    plain = kit.index_scores_kernel(q, w, keys_plain, index, 128 ** -0.5)
    assert torch.equal(got.isinf(), index < 0)
    fin = index >= 0
    diff = float((got[fin] - plain[fin]).abs().max() / plain[fin].abs().max())
    print(f"index scores, {heads} heads: vs unpacked keys {diff:.2e}, bitwise {torch.equal(got, plain)}")
    assert diff <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("model", ["random:deepseek_v41:tiny:10", "random:deepseek_v4:tiny:4"])
def test_engine_fp8_cache(model, backend):
    """Reference set: bitwise the model-dtype cache. Triton set: the first token's logprobs (prefill through the
    packed entries) within 5e-2, and the count of greedy tokens that agree printed."""
    from deepinfer import LLM, SamplingParams
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 7, 9, 11 + i] * (20 + 11 * i)} for i in range(4)]
    got = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, device=DEV, dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=4, state_memory_bytes=1 << 28,
                  kernel_backend=backend)
        out = llm.generate(prompts, params, use_tqdm=False)
        got[kv] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                   for o in out]
    if backend == "reference":
        assert got["auto"] == got["fp8"]
        return
    same = sum(a == b for (ta, _), (tb, _) in zip(got["auto"], got["fp8"]) for a, b in zip(ta, tb))
    print(f"{model} triton: {same} of {4 * 24} greedy tokens agree")
    for (ta, la), (tb, lb) in zip(got["auto"], got["fp8"]):
        assert ta[0] == tb[0] and abs(la[0][ta[0]] - lb[0][tb[0]]) <= 5e-2
