"""V4.1 on the GPU (skipped without CUDA): bf16 parity bound against transformers main's deepseek_v41
(opt-in reference, as tests/test_parity_v41.py) and the released-dim flash stack."""

from __future__ import annotations

import pytest
import torch

from tests.helpers_v41 import tiny_v41_model, tiny_v41_tokenizer
from tests.test_parity_v41 import hf_twin, reference_or_skip

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("length", (1, 129, 700))
def test_bf16_parity_with_reference(length):
    """As the V4 bound (docs/model.md): both bf16 runs are measured against our fp32 forward (which equals the
    reference's fp32), and ours must be no worse than the reference's own bf16 (1.5x + slack)."""
    ref = reference_or_skip()
    exact = tiny_v41_model(torch.float32, seed=1, device="cuda")
    ids = torch.randint(3, exact.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length)).cuda()
    truth = exact.compute_logits(ids)
    with torch.no_grad():
        twin32 = hf_twin(ref, exact, tiny_v41_tokenizer())
        assert (twin32(input_ids=ids, use_cache=True).logits.float() - truth).abs().max().item() <= 1e-3
    ours = tiny_v41_model(torch.bfloat16, seed=1, device="cuda")
    got = ours.compute_logits(ids)
    with torch.no_grad():
        theirs = hf_twin(ref, ours, tiny_v41_tokenizer(), dtype=torch.bfloat16)(input_ids=ids, use_cache=True)
    theirs = theirs.logits.float()
    err_ours, err_ref = (got - truth).abs().max().item(), (theirs - truth).abs().max().item()
    mean_ours, mean_ref = (got - truth).abs().mean().item(), (theirs - truth).abs().mean().item()
    agree_ours = (got.argmax(-1) == truth.argmax(-1)).float().mean().item()
    agree_ref = (theirs.argmax(-1) == truth.argmax(-1)).float().mean().item()
    print(f"\n[v41 bf16 parity] T={length}: max|ours-fp32| {err_ours:.4f} vs reference {err_ref:.4f}; "
          f"mean {mean_ours:.4f} vs {mean_ref:.4f}; greedy agreement {agree_ours:.3f} vs {agree_ref:.3f}")
    assert err_ours <= 1.5 * err_ref + 0.02
    assert mean_ours <= 1.5 * mean_ref + 1e-3
    assert 1 - agree_ours <= 1.5 * (1 - agree_ref) + 0.02
