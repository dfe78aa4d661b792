"""Full-forward logits equal transformers==5.23.0's DeepseekV4ForCausalLM (qat_fake_quant off, fp32)."""

import pytest
import torch

from deepinfer import load_model
from deepinfer.checkpoint.make import make_checkpoint
from deepinfer.reference import compute_logits

from .helpers import SCHEDULES, our_model, transformers_twin

pytestmark = pytest.mark.usefixtures("transformers_v4_reference")   # tests/conftest.py: 5.23.0 or skip
LENGTHS = (1, 127, 128, 129, 300, 700)
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(SCHEDULES))
def pair(request):
    ours = our_model(SCHEDULES[request.param], seed=1)
    return ours, transformers_twin(ours)


@pytest.mark.parametrize("length", LENGTHS)
def test_full_forward_logits_match(pair, length):
    ours, twin = pair
    gen = torch.Generator().manual_seed(length)
    batch = 2 if length <= 300 else 1
    ids = torch.randint(0, ours.cfg.vocab_size, (batch, length), generator=gen)
    with torch.no_grad():
        ref = twin(ids).logits
    got = compute_logits(ours, ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL
    assert ref.std() > 0.1  # the comparison is not between near-constant outputs


def test_transformers_saved_checkpoint_loads(tmp_path):
    """transformers' save_pretrained (its own, reverse-converted names) -> deepinfer.load_model."""
    ours = our_model(SCHEDULES["tiny"], seed=2)
    twin = transformers_twin(ours)
    twin.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, qat_fake_quant=False)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = twin(ids).logits
    assert (compute_logits(loaded, ids) - ref).abs().max().item() <= TOL


def test_our_hf_export_loads_into_transformers(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    make_checkpoint("deepseek_v4", "tiny", "hf", seed=3, out=tmp_path / "ck")
    twin = DeepseekV4ForCausalLM.from_pretrained(tmp_path / "ck", dtype=torch.float32).eval()
    ours = load_model(tmp_path / "ck", qat_fake_quant=False)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 200), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = twin(ids).logits
    assert (compute_logits(ours, ids) - ref).abs().max().item() <= TOL
