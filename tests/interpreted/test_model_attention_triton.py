"""The whole runtime forward of the tiny V4 and V4.1 models with the Triton sparse sink attention, indexer scores
and fused mHC mixes (the Triton top-k is left out: its integer outputs equal the reference's exactly,
tests/interpreted/test_indexer_triton.py, and it is slow in the interpreter) (and the Triton route / permute), in Triton's interpreter, against the reference table: prefill chunks, decode and
verify rows in mixed steps, windows wrapping, compressor windows closing. float32 with the QAT steps off (in
fp32 the QAT's discrete roundings flip with last-bit differences; docs/model.md). Measured: max |diff| of the
logits / their max = 9.0e-7 (V4), 1.1e-6 (V4.1) (bound 1e-4)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import attention_triton as kat
from deepinfer.kernels import indexer_triton as kit
from deepinfer.kernels import mhc_triton as kmt
from deepinfer.kernels import registry
from deepinfer.kernels.table import use
from tests.helpers import our_model
from tests.helpers_v41 import tiny_v41_model
from tests.pooled_helpers import PooledSequences

BOUND = 1e-4


CALLS = {"attention": 0, "index": 0, "mhc": 0}


def _counted(name, fn):
    def run(*args, **kwargs):
        CALLS[name] += 1
        return fn(*args, **kwargs)
    return run


@pytest.fixture
def attention_in_the_triton_set(monkeypatch):
    """The Triton set as the op table lists these kernels, the kernels' launches counted."""
    monkeypatch.setitem(registry.OPS["sparse_sink_attention"], "triton",
                        "attention_triton:sparse_sink_attention_triton")
    monkeypatch.setitem(registry.OPS["sparse_index_scores"], "triton", "indexer_triton:sparse_index_scores_triton")
    monkeypatch.setitem(registry.OPS["hc_mixes"], "triton", "mhc_triton:hc_mixes_triton")
    monkeypatch.delitem(registry.OPS["top_k_indices"], "triton", raising=False)   # left out (the docstring)
    for name, mod, kernel in (("attention", kat, "sparse_attention"), ("index", kit, "index_scores_kernel"),
                              ("mhc", kmt, "hc_mixes_kernel")):
        monkeypatch.setattr(mod, kernel, _counted(name, getattr(mod, kernel)))
    CALLS.update(attention=0, index=0, mhc=0)


def _run(model, plan, table: str):
    total = {s: sum(p.get(s, 0) for p in plan) for s in plan[0]}
    seqs = PooledSequences(model, len(total), max(total.values()) + 8)
    ids = {s: torch.randint(5, model.cfg.vocab_size, (total[s],), generator=torch.Generator().manual_seed(s))
           for s in total}
    out = []
    with use(table) as t:
        assert t.backends["sparse_sink_attention"] == t.backends["sparse_index_scores"] == table
        assert t.backends["hc_mixes"] == table
        for feeds in plan:
            got = seqs.step({s: ids[s][seqs.done[s]:seqs.done[s] + n] for s, n in feeds.items()})
            out.append(torch.cat([got[s] for s in sorted(got)]))
    return torch.cat(out)


@pytest.mark.usefixtures("attention_in_the_triton_set")
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_model_forward_with_triton_attention(family):
    model = (our_model(dtype=torch.float32, qat=False) if family == "v4"
             else tiny_v41_model(dtype=torch.float32, qat=False))
    plan = [{1: 24, 2: 10}, {1: 1, 2: 3}, {1: 2, 2: 1}, {1: 1, 2: 9}]   # windows 16 / 8 wrap, windows close
    want = _run(model, plan, "reference")
    got = _run(model, plan, "triton")
    layers = model.cfg.num_hidden_layers
    assert CALLS["attention"] >= layers * len(plan) and CALLS["index"] >= len(plan)      # the kernels ran
    assert CALLS["mhc"] >= 2 * layers * len(plan)
    err = float((got - want).abs().max() / want.abs().max())
    print(f"{family}: max |triton - reference| / max = {err:.2e}")
    assert err <= BOUND, err
