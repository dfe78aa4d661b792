"""A long one-step prefill holds no [rows, entries]-sized tensor: the selection walks row blocks
(models/pooled.top_entries) and V4.1's YOCO-truncated layers keep only their own rows' products. (On the H200 a
131072-token step had asked for 128 GiB: an int64 [rows, entries] index of the ratio-1 layers built for every row
of the step and then cut to the truncated rows.)"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import LLM
from deepinfer.models.common import pooled
from deepinfer.runner.probe import StepProbe
from deepinfer.api import resolve_model

T = 4000                    # prompt rows: the tiny V4.1 has T entries in ratio-1 layers, widths of at most 1024


class _Widest(TorchDispatchMode):
    """Records every op output with two dims of at least T / 2 (a [rows, entries]-sized tensor)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor) and sum(d >= T // 2 for d in o.shape) >= 2:
                self.found.append((str(func), tuple(o.shape)))
        return out


@pytest.mark.parametrize("select_block", [1 << 14, 1 << 21])
def test_one_step_prefill_builds_no_rows_by_entries_tensor(select_block, monkeypatch):
    """1 << 14: every selection walks row blocks of at most 4 rows; 1 << 21: the step's rows go in blocks of 520 /
    1040 (ratio 1 / 2), the truncated layers' 22 rows in one (the path that had built the whole step's index)."""
    monkeypatch.setattr(pooled, "SELECT_BLOCK_ELEMENTS", select_block)
    llm = LLM(resolve_model("random:deepseek_v41:tiny:10", "cpu", "float32"), device="cpu",
              kernel_backend="reference", enforce_eager=True, async_scheduling=False, max_model_len=T + 16)
    probe = StepProbe(llm, 1, 0, T)
    assert probe.runner.truncate                     # the prefill computes its last row only: YOCO truncation on
    widest = _Widest()
    with widest:
        picked = probe.run()
    probe.close()
    assert picked.shape == (1,)
    assert widest.found == [], widest.found[:5]
