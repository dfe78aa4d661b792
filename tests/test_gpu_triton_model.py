"""The whole runtime forward of the tiny V4 and V4.1 models on a CUDA device (`-m gpu`) with the `triton` kernel
table (every Triton kernel in the sets: attention, indexer scores and top-k, mHC mixes, route / permute, experts,
linear_f32) against the `reference` table: prefill chunks, decode and verify rows in mixed steps, windows
wrapping, compressor windows closing (the plan of tests/interpreted/test_model_attention_triton.py).
- float32, QAT off, TF32 off: max |triton - reference| / max <= FP32_BOUND (fp32 kernels on ieee dots; summation
  order only).
- bf16 (QAT off): both tables measured against the fp32 reference forward; the triton table's error must be no
  worse than the reference table's own bf16 error (x 1.5 + slack), as tests/test_gpu.py bounds bf16 against
  transformers."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.table import use
from tests.helpers import our_model
from tests.helpers_v41 import tiny_v41_model
from tests.pooled_helpers import PooledSequences

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
FP32_BOUND = 1e-4
PLAN = [{1: 24, 2: 10}, {1: 1, 2: 3}, {1: 2, 2: 1}, {1: 1, 2: 9}]       # windows 16 / 8 wrap, windows close


def _model(family, dtype):
    build = our_model if family == "v4" else tiny_v41_model
    return build(dtype=dtype, qat=False, device="cuda")


def _run(model, table: str) -> torch.Tensor:
    total = {s: sum(p.get(s, 0) for p in PLAN) for s in PLAN[0]}
    seqs = PooledSequences(model, len(total), max(total.values()) + 8)
    ids = {s: torch.randint(5, model.cfg.vocab_size, (total[s],), generator=torch.Generator().manual_seed(s))
           .cuda() for s in total}
    out = []
    with use(table) as t:
        if table == "triton":
            assert all(t.backends[op] == "triton" for op in ("sparse_sink_attention", "sparse_index_scores",
                                                             "hc_mixes", "route", "linear_f32"))
        for feeds in PLAN:
            got = seqs.step({s: ids[s][seqs.done[s]:seqs.done[s] + n] for s, n in feeds.items()})
            out.append(torch.cat([got[s] for s in sorted(got)]).float())
    return torch.cat(out)


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_fp32_triton_table_equals_reference(family):
    model = _model(family, torch.float32)
    want, got = _run(model, "reference"), _run(model, "triton")
    err = float((got - want).abs().max() / want.abs().max())
    print(f"\n[triton table fp32] {family}: max |triton - reference| / max = {err:.2e}")
    assert err <= FP32_BOUND, err


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.parametrize("family", ["v4", "v41"])
def test_bf16_triton_table_no_worse_than_reference(family):
    truth = _run(_model(family, torch.float32), "reference")
    model = _model(family, torch.bfloat16)
    assert_no_worse(truth, _run(model, "reference"), _run(model, "triton"), f"triton table bf16 {family}")


def assert_no_worse(truth: torch.Tensor, ref: torch.Tensor, got: torch.Tensor, label: str) -> None:
    """got's max and mean error against the fp32 truth no worse than the reference table's (x 1.5 + slack)."""
    scale = truth.abs().max()
    err_ref, err_got = float((ref - truth).abs().max() / scale), float((got - truth).abs().max() / scale)
    mean_ref, mean_got = float((ref - truth).abs().mean() / scale), float((got - truth).abs().mean() / scale)
    print(f"\n[{label}] max err vs fp32 {err_got:.4f} (reference table {err_ref:.4f}), "
          f"mean {mean_got:.5f} ({mean_ref:.5f})")
    assert err_got <= 1.5 * err_ref + 0.02
    assert mean_got <= 1.5 * mean_ref + 1e-3


@pytest.mark.parametrize("family", ["v4", "v41"])
def test_programmatic_dependent_launch_changes_no_bit(family, monkeypatch):
    """Every Triton kernel launched with PDL on sm_90+ (kernels/pdl.py) waits for its predecessor before it reads:
    the whole forward's bits are those of launches without it."""
    from deepinfer.kernels import pdl as pdl_module

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    model = _model(family, torch.bfloat16)
    monkeypatch.setattr(pdl_module, "_PDL", True)           # DEEPINFER_PDL=1
    on = _run(model, "triton")
    monkeypatch.setattr(pdl_module, "_PDL", False)
    off = _run(model, "triton")
    assert torch.equal(on, off)
