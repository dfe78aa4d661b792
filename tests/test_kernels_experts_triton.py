"""kernels/experts_triton.py on the GPU (`-m gpu`): the compiled Triton kernels against the reference backend's
same recipe at released expert widths (bf16 compute; FP4, FP8 and bf16 weights; A16 and A8), the edge cases
(no rows, one row, all rows on one expert), CUDA-graph capture (no host sync), and the invariant configuration's
row independence, the last two also for matmul_ogs on Hopper-layout weights (tests/test_gpu_experts_ogs.py has the
rest of that path). CPU CI runs the same kernels in Triton's interpreter (tests/interpreted/)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

triton = pytest.importorskip("triton")

from deepinfer.harness.kernel_bench import random_expert_weights, routed_batch   # noqa: E402
from deepinfer.kernels import experts_triton as kt                                # noqa: E402
from deepinfer.kernels.experts import grouped_experts                             # noqa: E402
from deepinfer.kernels.table import use                                           # noqa: E402

# max |kernel - reference| / max |reference| in bf16 (h rounded to bf16 between the GEMMs on both sides, so a
# 1-ulp difference of h in fp32 summation order moves the output by ~2^-8 of one term at most)
BOUND = {"a16": 1e-2, "a8": 2e-2}
SHAPES = {"v4": (4096, 2048), "v41": (5120, 2304)}


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("storage,num", [("fp4", "a16"), ("fp4", "a8"), ("fp8", "a16"), ("fp8", "a8"),
                                         ("bf16", "a16")])
@pytest.mark.parametrize("tokens", [1, 16, 256, 2048])
def test_kernels_equal_reference(shape, storage, num, tokens):
    dim, inter = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    ew = random_expert_weights(storage, 32, dim, inter, num == "a8", "cuda", gen)
    x, ids, offs, r, _ = routed_batch(tokens, 32, dim, 6, "cuda", gen)
    with use("reference"):
        want = grouped_experts(x, ids, offs, r, ew)
    for backend in ("triton", "triton_invariant"):
        with use(backend):
            got = grouped_experts(x, ids, offs, r, ew)
        assert rel(got, want) <= BOUND[num], (backend, rel(got, want))


def edge_batches(gen, n_experts: int = 16, dim: int = 4096):
    """(x, ids, offsets, r) for one row, all rows on one expert, two experts, two rows on the last expert (most
    experts get no rows)."""
    for experts, m in (([7], 1), ([7], 300), ([0, 15], 65), ([15], 2)):
        ids = torch.tensor(experts, device="cuda")[torch.randint(0, len(experts), (m,), device="cuda",
                                                                 generator=gen)].sort().values
        offs = torch.searchsorted(ids, torch.arange(n_experts + 1, device="cuda"))
        x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        yield x, ids, offs, torch.rand(m, device="cuda", generator=gen)


@pytest.mark.parametrize("storage", ["fp4", "fp8"])
def test_edge_rows(storage):
    gen = torch.Generator(device="cuda").manual_seed(3)
    ew = random_expert_weights(storage, 16, 4096, 2048, True, "cuda", gen)
    for x, ids, offs, r in edge_batches(gen):
        with use("reference"):
            want = grouped_experts(x, ids, offs, r, ew)
        for tiles in (kt.DECODE, kt.PREFILL, kt.INVARIANT, kt.INVARIANT_FP4):
            assert rel(kt.run(x, offs, r, ew, tiles), want) <= BOUND["a8"]


@pytest.mark.parametrize("tokens", [1, 64, 2048])
def test_fp4_byte_table_decode(tokens):
    """The prmt byte-table FP4 decode (Tiles.lut_fp4: DECODE has it on) equals the reference in every tile config."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    ew = random_expert_weights("fp4", 32, 5120, 2304, False, "cuda", gen)
    x, ids, offs, r, _ = routed_batch(tokens, 32, 5120, 6, "cuda", gen)
    with use("reference"):
        want = grouped_experts(x, ids, offs, r, ew)
    for tiles in (kt.DECODE, kt.PREFILL, kt.INVARIANT, kt.INVARIANT_FP4):
        assert rel(kt.run(x, offs, r, ew, dataclasses.replace(tiles, lut_fp4=True)), want) <= BOUND["a16"]


def _laid_out(ew, layout: str):
    """ew as built (rows) or a Hopper-layout copy (matmul_ogs runs it; skipped where it cannot)."""
    if layout == "rows":
        return ew
    from deepinfer.kernels import experts_ogs as ogs
    if not ogs.runs_on("cuda"):
        pytest.skip("matmul_ogs needs sm_90 and triton_kernels")
    return ogs.hopper_copy(ew)


@pytest.mark.parametrize("layout", ["rows", "hopper_mx"])
def test_graph_capture(layout):
    gen = torch.Generator(device="cuda").manual_seed(4)
    ew = _laid_out(random_expert_weights("fp4", 64, 4096, 2048, False, "cuda", gen), layout)
    x, ids, offs, r, _ = routed_batch(8, 64, 4096, 6, "cuda", gen)
    with use("triton"):
        grouped_experts(x, ids, offs, r, ew)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = grouped_experts(x, ids, offs, r, ew)
        x2, ids2, offs2, r2, _ = routed_batch(8, 64, 4096, 6, "cuda", gen)    # new rows and routing, same shapes
        for dst, src in ((x, x2), (ids, ids2), (offs, offs2), (r, r2)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, grouped_experts(x2, ids2, offs2, r2, ew))


@pytest.mark.parametrize("storage,act_fp8,layout", [("fp4", True, "rows"), ("fp4", False, "rows"),
                                                    ("bf16", False, "rows"), ("fp4", False, "hopper_mx")])
def test_invariant_rows_do_not_depend_on_the_batch(storage, act_fp8, layout):
    """A row's output bits from triton_invariant are the same alone and inside a batch of 500 rows (FP4: the BM 16
    configuration, A8 and A16; bf16: BM 64; matmul_ogs: BM pinned to 16, where the default would pick another)."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    ew = _laid_out(random_expert_weights(storage, 32, 4096, 2048, act_fp8, "cuda", gen), layout)
    x, ids, offs, r, _ = routed_batch(500, 32, 4096, 6, "cuda", gen)
    with use("triton_invariant"):
        full = grouped_experts(x, ids, offs, r, ew)
        for j in (0, 137, x.shape[0] - 1):
            e = int(ids[j])
            one = torch.zeros(33, dtype=torch.long, device="cuda")
            one[e + 1:] = 1
            alone = grouped_experts(x[j:j + 1], ids[j:j + 1], one, r[j:j + 1], ew)
            assert torch.equal(alone[0], full[j])
