"""The FP8 KV cache option (kv_cache_dtype="fp8", kernels/kv_formats.py): the release's packed records, their
exactness on QAT-rounded rows, their error on raw rows, the pools' sizes and snapshots, and whole engines whose
greedy tokens and logprobs equal the model-dtype cache's bit for bit (QAT on, bf16)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cache.pools import PoolLayout, StatePools
from deepinfer.config.presets import preset_config
from deepinfer.errors import DeepInferError
from deepinfer.kernels.kv_formats import INDEX_KEY, V4_LATENT, V41_ENTRY, V41_WINDOW, KVFormat, PackedStore, raw
from deepinfer.kernels.quant import fake_quant_fp4, fake_quant_fp8


def rows(n=400, width=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g) * torch.logspace(-8, 3, n).unsqueeze(1)     # every scale range


def qat(fmt: KVFormat, x: torch.Tensor) -> torch.Tensor:
    """What the models' QAT makes of a row (models/qat.py, models/csa2.py, attention_v41.window_kv)."""
    if fmt.kind == "fp8":
        head = fake_quant_fp8(x[..., :fmt.quantized], fmt.block)
        return torch.cat([head, x[..., fmt.quantized:].to(torch.bfloat16).float()], -1)
    return fake_quant_fp4(x, fmt.block, scale_fmt=fmt.scale)


@pytest.mark.parametrize("fmt", [V4_LATENT, V41_WINDOW, V41_ENTRY, INDEX_KEY], ids=["v4", "v41w", "v41e", "idx"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qat_rows_pack_and_unpack_to_themselves(fmt, dtype):
    for seed in range(3):
        x = qat(fmt, rows(width=fmt.width, seed=seed)).to(dtype)
        assert torch.equal(fmt.unpack(fmt.pack(x), dtype), x)
        # packing the raw row is the QAT's rounding itself
        r = rows(width=fmt.width, seed=seed)
        assert torch.equal(fmt.unpack(fmt.pack(r), torch.float32), qat(fmt, r))


def test_record_sizes_are_the_releases():
    assert (V4_LATENT.record_bytes, V41_WINDOW.record_bytes, V41_ENTRY.record_bytes, INDEX_KEY.record_bytes) == \
        (584, 528, 288, 68)
    with pytest.raises(ValueError, match="blocks of 64"):
        KVFormat("fp8", 100, 64)


def test_raw_rows_round_within_the_formats_error():
    """Without QAT the cache rounds: per row, max error / max |row| (e4m3: 2^-4 relative per value; e2m1 coarser),
    on rows of magnitude >= 1e-2 (below the e4m3 scale's floor, 6 * 2^-9 / 6, V4.1 entries round to 0, as the
    QAT does)."""
    x = rows(width=512)[int(400 * 6 / 11):]
    for fmt, bound in ((V41_WINDOW, 0.0625), (V4_LATENT, 0.0625), (V41_ENTRY, 0.34), (INDEX_KEY, 0.34)):
        x_ = x[:, :fmt.width]
        err = (fmt.unpack(fmt.pack(x_), torch.float32) - x_).abs().amax(1) / x_.abs().amax(1)
        assert 0 < float(err.max()) <= bound, (fmt, float(err.max()))


def test_packed_store_reads_and_writes_values():
    s = PackedStore(torch.zeros(3, 4, 528, dtype=torch.uint8), V41_WINDOW, torch.bfloat16)
    v = qat(V41_WINDOW, rows(2))
    s[torch.tensor([1, 2]), torch.tensor([0, 3])] = v
    assert s.shape == (3, 4, 512) and s.dtype == torch.bfloat16 and s.dim() == 3
    flat = s.flatten(0, 1)
    assert torch.equal(flat[torch.tensor([4, 11])], v.to(torch.bfloat16))
    assert torch.equal(flat[torch.tensor([0])], torch.zeros(1, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="uint8"):
        PackedStore(torch.zeros(3, 527, dtype=torch.uint8), V41_WINDOW, torch.bfloat16)
    with pytest.raises(ValueError, match="record dimension"):
        s.flatten(0, 2)


@pytest.mark.parametrize("arch,expect", [("deepseek_v4", {"window": 584, "kv": 584, "index": 68}),
                                         ("deepseek_v41", {"window": 528, "kv": 288, "index": 68})])
def test_flash_layouts_store_the_release_records(arch, expect):
    from deepinfer.models import MODEL_CLASSES
    cfg = preset_config(arch, "flash", 4)
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.model_type](cfg, dtype=torch.bfloat16, qat_fake_quant=True)
    spec = model.state_spec()
    lay, bf16 = PoolLayout.of(spec, torch.bfloat16, kv_cache_dtype="fp8"), PoolLayout.of(spec, torch.bfloat16)
    for kind in spec.rings + spec.entries:
        suffix = kind.name.split(".")[-1]               # 3.window, 3.kv, 3.index, mtp.0.window
        if kind.packed is not None:
            assert lay.row_bytes(kind) == expect[suffix], kind.name
            assert bf16.row_bytes(kind) == 2 * kind.width
        else:
            assert lay.row_bytes(kind) == bf16.row_bytes(kind)
    assert lay.bytes_per_token() < 0.6 * bf16.bytes_per_token()


def test_pools_snapshot_packed_rings_as_stored():
    from deepinfer.cache.spec import Ring, StateSpec
    spec = StateSpec.of([Ring("w", 8, 512, packed=V41_WINDOW), Ring("p", 4, 16, "accum")])
    pools = StatePools(PoolLayout.of(spec, torch.bfloat16, kv_cache_dtype="fp8"), 2, 0, 64, torch.device("cpu"))
    ring = pools.rings["w"]
    assert isinstance(ring, PackedStore) and raw(ring).shape == (3, 8, 528)
    ring[1, torch.arange(8)] = qat(V41_WINDOW, rows(8))
    before = ring[1, torch.arange(8)].clone()
    snap = pools.snapshot(1)
    ring[1, torch.arange(8)] = torch.zeros(8, 512)
    pools.restore(1, snap)
    assert torch.equal(ring[1, torch.arange(8)], before)
    assert pools.nbytes() == 3 * 8 * 528 + 3 * 4 * 16 * 4 + pools.block_table.numel() * 4


def test_bad_kv_cache_dtype_is_one_line():
    from deepinfer.cache.spec import Ring, StateSpec
    with pytest.raises(DeepInferError, match="kv_cache_dtype='fp9' is not known"):
        PoolLayout.of(StateSpec.of([Ring("w", 8, 512)]), torch.bfloat16, kv_cache_dtype="fp9")
    with pytest.raises(DeepInferError, match="declares no FP8 cache layout"):
        PoolLayout.of(StateSpec.of([Ring("w", 8, 512)]), torch.bfloat16, kv_cache_dtype="fp8")
    from deepinfer import LLM
    with pytest.raises(DeepInferError, match="kv_cache_dtype='int4' is not known"):
        LLM("random:deepseek_v4:tiny:4", kv_cache_dtype="int4")


@pytest.mark.parametrize("model", ["random:deepseek_v41:tiny:10", "random:deepseek_v4:tiny:4"])
def test_engine_with_fp8_cache_equals_the_model_dtype_cache(model):
    """QAT on, bf16: every packed row is already on its record's grid, so tokens and logprobs are bitwise equal
    (chunked prefill, decode across window wraps and compressor closes, a batch of three)."""
    from deepinfer import LLM, SamplingParams
    params = SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 7, 9, 11 + i] * (20 + 11 * i)} for i in range(3)]
    got = {}
    for kv in ("auto", "fp8"):
        llm = LLM(model, dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=3, max_num_batched_tokens=64)
        out = llm.generate(prompts, params, use_tqdm=False)
        got[kv] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                   for o in out]
    assert got["auto"] == got["fp8"]


def test_kernels_read_records_in_place_only_for_bf16_and_fp32():
    from deepinfer.kernels.kv_formats_triton import readable
    data = torch.zeros(4, INDEX_KEY.record_bytes, dtype=torch.uint8)
    assert readable(PackedStore(data, INDEX_KEY, torch.bfloat16), 128)
    assert readable(PackedStore(data, INDEX_KEY, torch.float32), 128)
    assert not readable(PackedStore(data, INDEX_KEY, torch.float16), 128)      # the reference reads those
    assert not readable(PackedStore(data, INDEX_KEY, torch.bfloat16), 64) and not readable(data, 128)


def test_a_model_whose_widths_fit_no_record_keeps_model_dtype_rows():
    import dataclasses
    from deepinfer.config.presets import TINY_V4
    from deepinfer.models import build_model
    cfg = dataclasses.replace(TINY_V4, qk_rope_head_dim=16)          # 80 non-RoPE channels: no FP8 latent record
    spec = build_model(cfg, "cpu", torch.float32, qat_fake_quant=False).state_spec()
    assert all(k.packed is None for k in spec.rings if k.name.endswith(".window"))
    assert PoolLayout.of(spec, torch.float32).bytes_per_token() > 0             # "auto" builds as before
