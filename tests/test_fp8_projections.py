"""projection_storage="fp8": the release's FP8 projections kept as e4m3 + block scales and run through fp8_linear
(DeepSeek's W8A8 recipe), against the dense model that dequantizes them on load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer import LLM, SamplingParams, load_model
from deepinfer.checkpoint.make import make_checkpoint, random_model
from deepinfer.checkpoint.random_init import FP8_WEIGHTS, FP8_WEIGHTS_V41
from deepinfer.errors import DeepInferError
from deepinfer.kernels.quant import fake_quant_fp8
from deepinfer.config.presets import TINY_V4
from deepinfer.models import build_model, projection_storage_of
from deepinfer.models.common.layers import Fp8Linear, Linear
from deepinfer.reference import compute_logits


def _fp8_modules(model) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def pair(request):
    """A tiny preset (V4: 128x128 blocks, V4.1: 32x32), seed 0, dense and FP8-resident (float32 compute)."""
    kw = dict(device="cpu", dtype=torch.float32)
    return random_model(request.param, "tiny", 0, **kw), random_model(request.param, "tiny", 0,
                                                                      projection_storage="fp8", **kw)


def test_which_projections_turn_fp8(pair):
    dense, fp8 = pair
    swapped = _fp8_modules(fp8)
    fp8_names = FP8_WEIGHTS_V41 if dense.cfg.model_type == "deepseek_v41" else FP8_WEIGHTS
    want = {n for n, m in dense.named_modules() if isinstance(m, Linear) and f"{n}.weight".endswith(fp8_names)
            and not n.endswith("attn.wo_a")}
    assert set(swapped) == want and len(want) > 20
    pinned = {"attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "ffn.shared_experts.w1", "ffn.shared_experts.w2",
              "ffn.shared_experts.w3"}                                   # the release's FP8 list, wo_a excepted
    assert {n[len("layers.0."):] for n in swapped if n.startswith("layers.0.")} == pinned
    assert isinstance(fp8.get_submodule("layers.0.attn.wo_a"), Linear)      # DeepSeek's reference runs it in BF16
    assert projection_storage_of(fp8) == "fp8" and projection_storage_of(dense) == "dense"
    block = dense.cfg.quant.weight_block_size[0]
    for m in swapped.values():
        assert m.weight.dtype == torch.float8_e4m3fn and m.scale.dtype == torch.float32 and m.block == block


def test_same_weights_as_the_dense_model(pair):
    """The random draws are the dense model's: dequantized FP8 projections equal its weights bit for bit, and
    every other tensor is identical."""
    dense, fp8 = pair
    for name, m in _fp8_modules(fp8).items():
        assert torch.equal(m.dequantized(), dense.get_submodule(name).weight), name
    sd, sf = dense.state_dict(), fp8.state_dict()
    shared = [k for k in sf if k in sd and sf[k].dtype == sd[k].dtype]
    assert len(shared) > 50 and all(torch.equal(sd[k], sf[k]) for k in shared)


def test_projection_runs_the_w8a8_recipe(pair):
    """Each FP8 projection computes fake_quant_fp8(x) @ dequant(W)^T (1 x block activation scales, ue8m0)."""
    _, fp8 = pair
    m = fp8.get_submodule("layers.1.attn.wq_b")
    x = torch.randn(5, m.in_features, generator=torch.Generator().manual_seed(3))
    padded = torch.nn.functional.pad(x, (0, -m.in_features % m.block))           # a ragged block: zeros add no amax
    want = fake_quant_fp8(padded, m.block, round_scale=True)[:, :m.in_features] @ m.dequantized().T
    got = m(x)
    assert got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert not torch.allclose(got, x @ m.dequantized().T, rtol=0, atol=1e-6)     # the activations were quantized


def test_logits_close_to_the_dense_model(pair):
    """W8A8 against the dense (W8A16) model on the same weights: the logits differ by the activation
    quantization only (e4m3 keeps 3 mantissa bits: ~2.7% rms per activation), so they differ no more than the
    dense model's do under 2.7% rms random noise on the inputs of the same projections. Measured over 40 tokens
    (relative rms of the logit difference): V4 (4 layers) FP8 0.074 against noise 0.111; V4.1 (10 layers) 0.46
    against 0.51. The tiny V4.1 model is that sensitive to any activation error since its routers are calibrated
    to balance (docs/bench.md): a token's top-k experts then hold near-ties that small errors flip (its first
    position moves by 0.78 of the largest logit, where the drawn, concentrated routers moved it by 0.09). V4 keeps
    its per-position bounds: the first position 0.2, the whole sequence 0.25."""
    dense, fp8 = pair
    ids = torch.randint(0, dense.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    a, b = compute_logits(dense, ids)[0], compute_logits(fp8, ids)[0]
    gen = torch.Generator().manual_seed(7)

    def noisy(_module, args):
        return (args[0] * (1 + 0.027 * torch.randn(args[0].shape, generator=gen)), *args[1:])
    hooks = [dense.get_submodule(n).register_forward_pre_hook(noisy)
             for n, m in fp8.named_modules() if isinstance(m, Fp8Linear)]
    try:
        c = compute_logits(dense, ids)[0]
    finally:
        for h in hooks:
            h.remove()
    rel_rms = lambda x: float(((a - x).pow(2).mean() / a.pow(2).mean()).sqrt())     # noqa: E731
    assert 0 < rel_rms(b) <= 1.25 * rel_rms(c), (rel_rms(b), rel_rms(c))
    if dense.cfg.model_type == "deepseek_v4":
        per_position = (a - b).abs().amax(-1) / a.abs().amax(-1)
        assert 0 < per_position[0] < 0.2 and per_position.max() < 0.25


@pytest.fixture(scope="module")
def tiny_v41_checkpoint_dir(tmp_path_factory):
    return make_checkpoint("deepseek_v41", "tiny", "deepseek", 0, tmp_path_factory.mktemp("v41") / "ckpt")


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_load_checkpoint_fp8_resident(arch, request):
    """DeepSeek's layout (FP8 e4m3 + e8m0 scales on disk) loads into the FP8 modules without a dequantize: the
    values equal the dense load's."""
    ckpt = request.getfixturevalue("tiny_checkpoint_dir" if arch == "deepseek_v4" else "tiny_v41_checkpoint_dir")
    dense = load_model(ckpt)
    fp8 = load_model(ckpt, projection_storage="fp8")
    mods = _fp8_modules(fp8)
    assert mods
    for name, m in mods.items():
        assert torch.equal(m.dequantized(), dense.get_submodule(name).weight), name


def test_llm_generates_with_fp8_projections(tiny_checkpoint_dir):
    llm = LLM(model=str(tiny_checkpoint_dir), projection_storage="fp8", max_num_seqs=2)
    assert projection_storage_of(llm.model) == "fp8"
    out = llm.generate(["hello there", "a b c"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]


def test_refusals(tiny_checkpoint_copy):
    with pytest.raises(DeepInferError, match=r"projection_storage='fp16' is not supported; use 'dense' or 'fp8'"):
        load_model(tiny_checkpoint_copy, projection_storage="fp16")
    odd = dataclasses.replace(TINY_V4, quant=dataclasses.replace(TINY_V4.quant, weight_block_size=(64, 64)))
    with pytest.raises(DeepInferError, match=r"square weight blocks of 32 \(V4.1\) or 128 \(V4\); this config has "
                                             r"weight_block_size=\[64, 64\]: use projection_storage='dense'"):
        build_model(odd, projection_storage="fp8")
    dense = random_model("deepseek_v4", "tiny", 0, device="cpu", dtype=torch.float32)
    dense.checkpoint_dir = tiny_checkpoint_copy
    with pytest.raises(DeepInferError, match=r"does not match the model passed in.*'dense'"):
        LLM(model=dense, projection_storage="fp8")
    # a projection stored as float where the release has FP8: refused, not silently quantized
    index = json.loads((tiny_checkpoint_copy / "model.safetensors.index.json").read_text())["weight_map"]
    key = "layers.0.attn.wq_a.weight"
    shard = tiny_checkpoint_copy / index[key]
    tensors = load_file(shard)
    tensors[key] = tensors[key].to(torch.bfloat16)
    save_file(tensors, shard)
    with pytest.raises(DeepInferError, match=r"layers.0.attn.wq_a.weight has dtype torch.bfloat16, but "
                                             r"projection_storage='fp8'.*load with projection_storage='dense'"):
        load_model(tiny_checkpoint_copy, projection_storage="fp8")


def test_export_refused_and_keep_quantized(tiny_checkpoint_dir, tmp_path):
    from deepinfer.checkpoint.writer import write_checkpoint
    fp8 = load_model(tiny_checkpoint_dir, projection_storage="fp8", keep_quantized=True)
    with pytest.raises(DeepInferError, match=r"write_checkpoint: this model keeps its FP8 projections resident"):
        write_checkpoint(fp8, tmp_path / "out", "deepseek")
    assert not (tmp_path / "out").exists()
    m = fp8.get_submodule("layers.0.attn.wq_b")
    q = m.quantized
    assert q.fmt == "fp8" and q.data is m.weight and q.scale is m.scale and q.block == (128, 128)


def test_nan_in_an_fp8_weight_is_refused(tiny_checkpoint_copy):
    """e4m3fn NaN (byte 0x7F) in a resident FP8 weight: one line naming the tensor, as for the dense load."""
    index = json.loads((tiny_checkpoint_copy / "model.safetensors.index.json").read_text())["weight_map"]
    key = "layers.1.attn.wkv.weight"
    shard = tiny_checkpoint_copy / index[key]
    tensors = load_file(shard)
    raw = tensors[key].view(torch.uint8).clone()
    raw[3, 5] = 0x7F
    tensors[key] = raw.view(torch.float8_e4m3fn)
    save_file(tensors, shard)
    with pytest.raises(DeepInferError, match=r"tensor layers.1.attn.wkv.weight: 1 of its \d+ e4m3 values are NaN"):
        load_model(tiny_checkpoint_copy, projection_storage="fp8")


def test_llm_random_model_with_fp8_projections():
    llm = LLM(model="random:deepseek_v4:tiny:2", projection_storage="fp8", max_num_seqs=1)
    assert projection_storage_of(llm.model) == "fp8"
    out = llm.generate(["a"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 3
