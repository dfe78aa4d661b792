"""Random routers calibrated like trained ones (engine/checkpoint/routers.py): balanced and diverse on the harness's
prompts, deterministic per seed, skewed on request; hash tables untouched; the random-spec and CLI spellings."""

import dataclasses

import pytest
import torch
from click.testing import CliRunner

from deepinfer.checkpoint.make import preset_model_config, random_model
from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.checkpoint.routers import (calibrate_routers, calibration_ids, fit_bias, routed_gates,
                                          target_shares)
from deepinfer.config.deepseek_v4 import HASH_MOE, MOE
from deepinfer.errors import DeepInferError
from deepinfer.models import build_model
from deepinfer.models.common.moe import Gate
from deepinfer.parallel.traffic import uniform_touched
from deepinfer.validate import check_router_skew, parse_random_spec
from deepinfer.reference import batch_chunks, forward_reference, new_state


def flash_shaped(arch: str) -> tuple:
    """Tiny widths with the flash routers' shape (V4.1: 384 experts, top-6, one layer; V4: 256, top-6, one
    learned layer after one hash layer): (config, tokenizer)."""
    if arch == "deepseek_v4":
        cfg, _ = preset_model_config(arch, "tiny", None)
        cfg = dataclasses.replace(cfg, n_routed_experts=256, num_experts_per_tok=6, num_hidden_layers=2,
                                  layer_types=cfg.layer_types[:2], mlp_layer_types=(HASH_MOE, MOE))
        return cfg, None
    cfg, tok = preset_model_config(arch, "tiny", 1)
    return dataclasses.replace(cfg, n_routed_experts=384, num_experts_per_tok=6), tok


def drawn(cfg, tok, seed: int = 0):
    """The weights as drawn (routers not yet calibrated)."""
    model = build_model(cfg, "cpu", torch.float32, True)
    init_random_weights(model, seed)
    if getattr(cfg, "engram_layer_ids", None):
        model.bind_tokenizer(tok)
    return model


def routed_ids(model, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gate name -> ids [B, T, k] of one stateless forward over ids [B, T]."""
    out, hooks = {}, []

    def keep(name):
        def hook(_module, _args, result):
            out[name] = result[1]                    # (weights, ids); returns None: the output stays
        return hook
    for name, g in routed_gates(model):
        hooks.append(g.register_forward_hook(keep(name)))
    try:
        with torch.inference_mode():
            flat, chunks = batch_chunks(model, ids)
            forward_reference(model, flat, chunks, [new_state(model) for _ in chunks])
    finally:
        for h in hooks:
            h.remove()
    b, t = ids.shape
    return {n: v.view(b, t, -1) for n, v in out.items() if not n.startswith("mtp.")}


def touched_at(ids: torch.Tensor, batch: int, draws: int = 16) -> float:
    """Mean distinct experts of `batch` tokens drawn from distinct positions of ids [B, T, k]."""
    flat = ids.reshape(-1, ids.shape[-1])
    gen = torch.Generator().manual_seed(1)
    return sum(flat[torch.randperm(flat.shape[0], generator=gen)[:batch]].unique().numel()
               for _ in range(draws)) / draws


@pytest.fixture(scope="module", params=["deepseek_v41", "deepseek_v4"])
def flash_routers(request):
    cfg, tok = flash_shaped(request.param)
    model = drawn(cfg, tok)
    held = calibration_ids(cfg, seed=123, sequences=16, length=256)    # other prompts than the fit's
    before = routed_ids(model, held)
    calibrate_routers(model, 0, 0.0)
    return cfg, before, routed_ids(model, held)


@pytest.mark.parametrize("batch", [64, 256])
def test_calibrated_flash_routers_touch_what_a_uniform_router_does(flash_routers, batch):
    cfg, before, after = flash_routers
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    expect = uniform_touched(e, k, batch)
    for name, ids in after.items():
        assert abs(touched_at(ids, batch) - expect) <= 0.1 * expect, name
    # the drawn routers were the concentrated ones the issue measured
    assert min(touched_at(ids, batch) for ids in before.values()) < 0.5 * expect


def test_calibrated_flash_routers_spread_the_load(flash_routers):
    """Max/mean over 4096 held-out tokens: within 25% of what a uniform router reaches by chance at this load
    (1.28 at 256 experts, 1.40 at 384: the issue's 1.3 is below a uniform router's own at 384; docs/bench.md),
    where the drawn routers were tens of times the mean."""
    cfg, before, after = flash_routers
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    chance = sum(float((c := torch.bincount(torch.rand(4096, e, generator=gen).topk(k).indices.reshape(-1),
                                            minlength=e).float()).max() / c.mean()) for _ in range(8)) / 8
    for name, ids in after.items():
        load = torch.bincount(ids.reshape(-1), minlength=e).float()
        assert float(load.max() / load.mean()) <= 1.25 * chance, name
    assert max(float((c := torch.bincount(i.reshape(-1), minlength=e).float()).max() / c.mean())
               for i in before.values()) > 5


def test_calibration_is_deterministic_per_seed_and_keeps_hash_tables():
    cfg, tok = preset_model_config("deepseek_v4", "tiny", None)
    a, b, c = drawn(cfg, tok), drawn(cfg, tok), drawn(cfg, tok, seed=1)
    tables = {n: m.tid2eid.clone() for n, m in a.named_modules() if isinstance(m, Gate) and m.is_hash}
    assert tables
    for m, seed in ((a, 0), (b, 0), (c, 1)):
        assert set(calibrate_routers(m, seed, 0.0)) == {n for n, _ in routed_gates(m)}
    for (name, ga), (_, gb), (_, gc) in zip(routed_gates(a), routed_gates(b), routed_gates(c)):
        assert torch.equal(ga.bias, gb.bias), name
        assert not torch.equal(ga.bias, gc.bias), name
    for n, m in a.named_modules():
        if n in tables:
            assert torch.equal(m.tid2eid, tables[n])


def test_random_model_routers_are_calibrated():
    """random_model (and so make-checkpoint, random: specs, the embedded model) calibrates, the draft stages too."""
    model = random_model("deepseek_v41", "tiny", 0, layers=2, dtype=torch.float32)
    twin = drawn(*preset_model_config("deepseek_v41", "tiny", 2))
    names = [n for n, _ in routed_gates(model)]
    assert any(n.startswith("mtp.") for n in names)
    for (name, g), (_, g0) in zip(routed_gates(model), routed_gates(twin)):
        assert not torch.equal(g.bias, g0.bias), name
        assert torch.equal(g.weight, g0.weight), name          # only the selection bias is fitted


def test_fit_bias_meets_the_target_shares_in_sample():
    gen = torch.Generator().manual_seed(0)
    e, k = 32, 4
    w = torch.randn(e, 32, generator=gen) / 32 ** 0.5
    scores = torch.nn.functional.softplus((torch.randn(4096, 32, generator=gen) + 1.5) @ w.t()).sqrt()
    for skew in (0.0, 0.8):
        share = target_shares(e, k, skew, torch.Generator().manual_seed(3))
        bias = fit_bias(scores, k, share)
        load = torch.bincount((scores + bias).topk(k).indices.reshape(-1), minlength=e).double()
        assert torch.allclose(load / load.sum(), share, atol=0.15 / e + 0.05 * share.max())
        assert bias.abs().sum() > 0
        assert torch.equal(bias, fit_bias(scores, k, share))


@pytest.mark.parametrize("e, skew, top, tenth", [(384, 0.0, 1.0, 0.099), (384, 0.4, 2.12, 0.171),
                                                 (384, 0.8, 4.08, 0.273), (384, 1.2, 7.11, 0.397),
                                                 (384, 2.0, 16.02, 0.647), (256, 0.8, 4.03, 0.269)])
def test_skew_load_curve_is_the_documented_one(e, skew, top, tenth):
    """docs/bench.md's table: the hottest expert's share over the mean, and the hottest tenth's share."""
    share = target_shares(e, 6, skew, torch.Generator().manual_seed(0)).sort(descending=True).values
    assert float(share.sum()) == pytest.approx(1.0)
    assert float(share[0] * e) == pytest.approx(top, abs=0.01)
    assert float(share[: e // 10].sum()) == pytest.approx(tenth, abs=0.001)
    assert float(share.max()) <= 1 / 6 + 1e-12


def test_skewed_model_routes_to_hot_experts():
    """A tiny V4 calibrated with skew 1.2: held-out loads follow target_shares (the same seeded ranks)."""
    cfg, tok = preset_model_config("deepseek_v4", "tiny", None)
    model = drawn(cfg, tok)
    calibrate_routers(model, 0, 1.2)
    gen = torch.Generator().manual_seed(0 ^ 0x5EED)
    shares = {name: target_shares(g.n_experts, g.top_k, 1.2, gen) for name, g in routed_gates(model)}
    routed = routed_ids(model, calibration_ids(cfg, seed=9, sequences=8, length=256))
    assert routed
    for name, ids in routed.items():
        g, share = dict(routed_gates(model))[name], shares[name]
        load = torch.bincount(ids.reshape(-1), minlength=g.n_experts).double()
        assert torch.allclose(load / load.sum(), share, atol=0.03), name
        assert float(share.max() * g.n_experts) > 2                # hot experts, not a balanced layer


def test_skew_spellings_and_bad_values():
    assert parse_random_spec("random:deepseek_v41:flash:4").skew == 0.0
    assert parse_random_spec("random:deepseek_v41:flash:4:skew=0.8").skew == 0.8
    for bad in ("random:deepseek_v41:flash:4:skew=x", "random:deepseek_v41:flash:4:skew=-1",
                "random:deepseek_v41:flash:4:skew=9", "random:deepseek_v41:flash:4:hot=1"):
        with pytest.raises(DeepInferError, match="skew=S"):
            parse_random_spec(bad)
    assert check_router_skew(1) == 1.0
    for bad in (True, "0.5", -0.1, float("nan"), 5):
        with pytest.raises(DeepInferError, match="router skew"):
            check_router_skew(bad)


def test_make_checkpoint_router_skew_option(tmp_path):
    from deepinfer.cli import cli
    res = CliRunner().invoke(cli, ["make-checkpoint", "--arch", "deepseek_v4", "--router-skew", "7",
                                   "--out", str(tmp_path / "x")])
    assert res.exit_code == 2 and "--router-skew" in res.output and not (tmp_path / "x").exists()
