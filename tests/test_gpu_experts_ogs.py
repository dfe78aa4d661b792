"""FP4 experts through triton_kernels' matmul_ogs (kernels/experts_ogs_triton.py) on an sm_90 GPU (`-m gpu`): both
Triton sets on Hopper-layout weights against the reference backend on the same weights in rows, at released
widths (V4 and V4.1) and E 32 / 384, the edge cases (one row, all rows on one expert, experts with no rows), and a
whole bf16 V4.1 model (FP4 experts at
widths the layout takes) whose triton table, with the experts converted by the engine's rule, is no worse against
the fp32 forward than the reference table. CUDA-graph capture and the invariant set's row independence run in
tests/test_kernels_experts_triton.py for both layouts. Skipped without sm_90 or triton_kernels (optional)."""

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
from deepinfer.kernels.experts import grouped_experts, weight_layout                  # noqa: E402
from deepinfer.kernels.table import use                                         # noqa: E402
from tests.test_kernels_experts_triton import edge_batches                       # noqa: E402

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
    for x, ids, offs, r in edge_batches(gen):
        with use("reference"):
            want = grouped_experts(x, ids, offs, r, ew)
        for invariant in (False, True):
            assert rel(ogs_triton.run(x, offs, r, hw, invariant), want) <= BOUND, (x.shape[0], invariant)


def test_bf16_model_with_ogs_experts_no_worse_than_reference():
    """A tiny V4.1 widened to 256 (the layout's alignment), FP4 experts, bf16, QAT off: the triton table after the
    engine's conversion (matmul_ogs experts) against the fp32 forward, no worse than the reference table."""
    from deepinfer.checkpoint.random_init import init_random_weights
    from deepinfer.models import build_model
    from deepinfer.models.common.moe import Experts, set_expert_layout
    from tests.helpers_v41 import tiny_v41_config, tiny_v41_tokenizer
    from tests.test_gpu_triton_model import _run, assert_no_worse

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
    assert_no_worse(truth, ref, _run(m, "triton"), "matmul_ogs experts bf16")
