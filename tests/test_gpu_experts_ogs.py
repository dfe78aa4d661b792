"""FP4 experts through triton_kernels' matmul_ogs (kernels/experts_ogs_triton.py) on an sm_90 GPU (`-m gpu`): both
Triton sets on Hopper-layout weights against the reference backend on the same weights in rows, at released
widths (V4 and V4.1) and E 32 / 384, the edge cases (one row, all rows on one expert, experts with no rows), CUDA
graph capture with new routing, the invariant set's row independence, and a whole bf16 V4.1 model (FP4 experts at
widths the layout takes) whose triton table, with the experts converted by the engine's rule, is no worse against
the fp32 forward than the reference table. Skipped without sm_90 or triton_kernels (an optional dependency)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")
pytest.importorskip("triton_kernels")

from deepinfer.harness.kernel_bench import random_expert_weights, routed_batch   # noqa: E402
from deepinfer.kernels import experts_ogs as ogs                                # noqa: E402
from deepinfer.kernels import experts_ogs_triton as ogs_triton                  # noqa: E402
from deepinfer.kernels.experts import ExpertWeights, grouped_experts, weight_layout   # noqa: E402
from deepinfer.kernels.table import use                                         # noqa: E402

if not ogs.runs_on("cuda"):
    pytest.skip("matmul_ogs's Hopper layouts need an sm_90 device", allow_module_level=True)

BOUND = 1e-2            # max |ogs - reference| / max |reference|, bf16 (tests/test_kernels_experts_triton.py's A16)
SHAPES = {"v4": (4096, 2048), "v41": (5120, 2304)}


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_engine_rule_picks_the_layout_here():
    assert weight_layout("triton", "cuda") == ogs.HOPPER == weight_layout("triton_invariant", "cuda")
    assert weight_layout("reference", "cuda") == ogs.ROWS


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("n_experts,tokens", [(32, 1), (32, 16), (32, 256), (32, 2048), (384, 64), (384, 1024)])
def test_ogs_equals_reference(shape, n_experts, tokens):
    dim, inter = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ew = random_expert_weights("fp4", n_experts, dim, inter, False, "cuda", gen)
    x, ids, offs, r, _ = routed_batch(tokens, n_experts, dim, 6, "cuda", gen)
    with use("reference"):
        want = grouped_experts(x, ids, offs, r, ew)
    hw = ogs.hopper_copy(ew)
    for backend in ("triton", "triton_invariant"):
        with use(backend):
            got = grouped_experts(x, ids, offs, r, hw)
        assert got.dtype == torch.float32 and rel(got, want) <= BOUND, (backend, rel(got, want))


def test_edge_rows():
    gen = torch.Generator(device="cuda").manual_seed(3)
    ew = random_expert_weights("fp4", 16, 4096, 2048, False, "cuda", gen)
    hw = ogs.hopper_copy(ew)
    for experts, m in (([7], 1), ([7], 300), ([0, 15], 65), ([15], 2)):   # most experts get no rows
        ids = torch.tensor(experts, device="cuda")[torch.randint(0, len(experts), (m,), device="cuda",
                                                                 generator=gen)].sort().values
        offs = torch.searchsorted(ids, torch.arange(17, device="cuda"))
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16, generator=gen)
        r = torch.rand(m, device="cuda", generator=gen)
        with use("reference"):
            want = grouped_experts(x, ids, offs, r, ew)
        for invariant in (False, True):
            assert rel(ogs_triton.run(x, offs, r, hw, invariant), want) <= BOUND, (experts, m, invariant)


def test_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(4)
    hw = ogs.hopper_copy(random_expert_weights("fp4", 64, 4096, 2048, False, "cuda", gen))
    x, ids, offs, r, _ = routed_batch(8, 64, 4096, 6, "cuda", gen)
    with use("triton"):
        grouped_experts(x, ids, offs, r, hw)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = grouped_experts(x, ids, offs, r, hw)
        x2, ids2, offs2, r2, _ = routed_batch(8, 64, 4096, 6, "cuda", gen)    # new rows and routing, same shapes
        for dst, src in ((x, x2), (ids, ids2), (offs, offs2), (r, r2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, grouped_experts(x2, ids2, offs2, r2, hw))


def test_invariant_rows_do_not_depend_on_the_batch():
    """A row's bits from triton_invariant (BM pinned to 16) are the same alone and inside 500 rows, whose
    default-set flags would pick another BM."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    hw = ogs.hopper_copy(random_expert_weights("fp4", 32, 4096, 2048, False, "cuda", gen))
    x, ids, offs, r, _ = routed_batch(500, 32, 4096, 6, "cuda", gen)
    with use("triton_invariant"):
        full = grouped_experts(x, ids, offs, r, hw)
        for j in (0, 137, x.shape[0] - 1):
            e = int(ids[j])
            one = torch.zeros(33, dtype=torch.long, device="cuda")
            one[e + 1:] = 1
            alone = grouped_experts(x[j:j + 1], ids[j:j + 1], one, r[j:j + 1], hw)
            assert torch.equal(alone[0], full[j])


def test_bf16_model_with_ogs_experts_no_worse_than_reference():
    """A tiny V4.1 widened to 256 (the layout's alignment), FP4 experts, bf16, QAT off: the triton table after the
    engine's conversion (matmul_ogs experts) against the fp32 forward, no worse than the reference table."""
    from deepinfer.checkpoint.random_init import init_random_weights
    from deepinfer.models import build_model
    from deepinfer.models.common.moe import Experts, set_expert_layout
    from tests.helpers_v41 import tiny_v41_config, tiny_v41_tokenizer
    from tests.test_gpu_triton_model import _run

    cfg = dataclasses.replace(tiny_v41_config(), hidden_size=256, moe_intermediate_size=256)

    def model(dtype):
        m = build_model(cfg, "cuda", dtype, qat_fake_quant=False, expert_storage="fp4")
        init_random_weights(m, 0)
        m.bind_tokenizer(tiny_v41_tokenizer())
        return m

    truth = _run(model(torch.float32), "reference")
    m = model(torch.bfloat16)
    ref = _run(m, "reference")
    set_expert_layout(m, weight_layout("triton", "cuda"))
    assert {x.layout for x in m.modules() if isinstance(x, Experts)} == {ogs.HOPPER}
    got = _run(m, "triton")
    scale = truth.abs().max()
    err_ref, err_got = float((ref - truth).abs().max() / scale), float((got - truth).abs().max() / scale)
    mean_ref, mean_got = float((ref - truth).abs().mean() / scale), float((got - truth).abs().mean() / scale)
    print(f"\n[matmul_ogs experts bf16] max err vs fp32 {err_got:.4f} (reference table {err_ref:.4f}), "
          f"mean {mean_got:.5f} ({mean_ref:.5f})")
    assert err_got <= 1.5 * err_ref + 0.02
    assert mean_got <= 1.5 * mean_ref + 1e-3
