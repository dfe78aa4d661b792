"""Export formats: DeepSeek (FP8/FP4) and HF exports of one seed load to identical logits; quantized
tensors stay reachable; Flash-Base style (float32 scales, FP8 experts) round-trips; flash dims add up."""

import dataclasses

import pytest
import torch

from deepinfer import load_model
from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.checkpoint.writer import write_checkpoint
from deepinfer.config.deepseek_v4 import WeightQuant
from deepinfer.config.presets import TINY_V4, preset_config
from deepinfer.models import build_model
from deepinfer.reference import compute_logits


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from deepinfer.checkpoint.make import make_checkpoint
    root = tmp_path_factory.mktemp("exports")
    return {fmt: make_checkpoint("deepseek_v4", "tiny", fmt, seed=7, out=root / fmt) for fmt in ("deepseek", "hf")}


@pytest.mark.parametrize("qat", [False, True])
def test_deepseek_and_hf_exports_give_identical_logits(exports, qat):
    ids = torch.randint(0, TINY_V4.vocab_size, (2, 160), generator=torch.Generator().manual_seed(0))
    a = compute_logits(load_model(exports["deepseek"], qat_fake_quant=qat), ids)
    b = compute_logits(load_model(exports["hf"], qat_fake_quant=qat), ids)
    assert torch.equal(a, b)


def test_deepseek_export_is_quantized_like_the_release(exports):
    from safetensors import safe_open
    from deepinfer.checkpoint.loader import shard_map
    dtypes = {}
    for shard in shard_map(exports["deepseek"]):
        with safe_open(str(exports["deepseek"] / shard), "pt") as f:
            dtypes.update({k: f.get_tensor(k).dtype for k in f.keys()})
    assert dtypes["layers.0.attn.wq_a.weight"] == torch.float8_e4m3fn
    assert dtypes["layers.0.attn.wq_a.scale"] == torch.float8_e8m0fnu
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == torch.int8      # packed e2m1
    assert dtypes["layers.0.ffn.experts.0.w1.scale"] == torch.float8_e8m0fnu
    assert dtypes["layers.0.ffn.gate.tid2eid"] == torch.int64
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == torch.bfloat16
    assert dtypes["layers.0.hc_attn_fn"] == torch.float32
    assert dtypes["embed.weight"] == torch.bfloat16


def test_keep_quantized_attaches_the_on_disk_tensors(exports):
    from deepinfer.kernels.quant import dequantize_fp4, dequantize_fp8_blocks
    model = load_model(exports["deepseek"], keep_quantized=True)
    wq_a = model.layers[0].attn.wq_a
    q = wq_a.quantized
    assert q.fmt == "fp8" and q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_fp8_blocks(q.data, q.scale, q.block, torch.float32), wq_a.weight)
    experts = model.layers[2].ffn.experts
    e3 = experts.quantized["w2"][3]
    assert e3.fmt == "fp4" and torch.equal(dequantize_fp4(e3.data, e3.scale, 32, torch.float32), experts.w2[3])


def test_flash_base_style_float32_scales_and_fp8_experts(tmp_path):
    cfg = dataclasses.replace(TINY_V4, quant=WeightQuant(scale_fmt="float32", expert_dtype="fp8",
                                                         weight_block_size=(32, 32)))
    model = build_model(cfg, "cpu", torch.float32, qat_fake_quant=False)
    init_random_weights(model, 3)
    write_checkpoint(model, tmp_path / "ck", "deepseek")
    loaded = load_model(tmp_path / "ck", qat_fake_quant=False)
    # float32 scales are not powers of two, so re-quantizing a dequantized weight can move its scale by an
    # ulp: equal to float32 rounding, not bitwise (ue8m0 exports above are bitwise).
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.allclose(p, q, rtol=1e-6, atol=0), name
    assert loaded.cfg.quant == cfg.quant


def test_flash_preset_dimensions():
    """The released V4-Flash shapes: 284.3B parameters in the main model (arch note §5), built on meta."""
    cfg = preset_config("deepseek_v4", "flash")
    with torch.device("meta"):
        from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
        model = DeepseekV4ForCausalLM(cfg, torch.bfloat16)
    main = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp."))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." in n and not n.startswith("mtp."))
    assert abs(main / 1e9 - 284.3) < 0.5 and abs(experts / 1e9 - 277.0) < 0.5
    assert cfg.layer_types[2] == "compressed_sparse_attention" and cfg.layer_types[3] == "heavily_compressed_attention"
