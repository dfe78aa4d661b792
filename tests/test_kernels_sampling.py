"""kernels/sampling.py on a CUDA device (`-m gpu`): the one-pass draw against the reference at the released vocabulary
(129280) for 1..256 rows, greedy, noisy and mixed rows; a row's id alone = in a batch; CUDA-graph capture; a
seeded engine request through the Triton set draws as through the reference set. Passing it is what puts the
kernel in the Triton sets (kernels/registry.py OPS)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

V = 129280


def _case(b, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(b, V, device="cuda", generator=g) * 4
    x[torch.rand(b, V, device="cuda", generator=g) < 0.05] = float("-inf")
    seeds = torch.randint(0, 1 << 40, (b,), device="cuda", generator=g)
    pos = torch.randint(0, 1 << 17, (b,), device="cuda", generator=g)
    return x, seeds, pos


@pytest.mark.parametrize("b", [1, 7, 64, 256])
def test_draw_equals_reference_on_cuda(b):
    from deepinfer.kernels import sampling_triton as ks
    x, seeds, pos = _case(b, b)
    rows = torch.arange(b, device="cuda") % 3 != 0
    for noise in (None, rows):
        got = ks.draw_kernel(x, noise, seeds, pos, 0)
        assert torch.equal(got, ks._reference(x, noise, seeds, pos, 0))
    alone = ks.draw_kernel(x[b - 1:], rows[b - 1:], seeds[b - 1:], pos[b - 1:], 0)
    assert torch.equal(alone, ks.draw_kernel(x, rows, seeds, pos, 0)[b - 1:])


def test_graph_capture():
    from deepinfer.kernels import sampling_triton as ks
    x, seeds, pos = _case(16, 3)
    rows = torch.ones(16, dtype=torch.bool, device="cuda")
    want = ks.draw_kernel(x, rows, seeds, pos, 1)
    graph, out = capture_graph(lambda a: ks.draw_kernel(a, rows, seeds, pos, 1), x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_seeded_engine_draws_as_the_reference_set():
    """The tiny V4 in fp32 on CUDA, seeded sampling with top-p: the triton and reference tables draw the same
    tokens (the logits agree to fp32 rounding; the draw is the same function of them)."""
    from deepinfer import LLM, SamplingParams
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 30))}, {"prompt_token_ids": list(range(40, 52))}]
    out = {}
    for backend in ("reference", "triton"):
        llm = LLM("tiny", device="cuda", dtype="float32", kernel_backend=backend)
        out[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
    assert out["triton"] == out["reference"]
