"""The one-sequence sink attention runs queries in row blocks sized from H and K (bounded prefill memory):
blocked and whole-tensor results agree on fresh random inputs, masked keys included."""

import torch

from deepinfer.kernels import attention


def _inputs(s: int, h: int, k: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, h, d, generator=g)
    kv = torch.randn(k, d, generator=g)
    visible = torch.rand(s, k, generator=g) < 0.7
    visible[:, 0] = True
    bias = torch.zeros(s, k).masked_fill(~visible, float("-inf"))
    sink = torch.randn(h, generator=g)
    return q, kv, bias, sink


def test_row_blocks_match_one_block(monkeypatch):
    q, kv, bias, sink = _inputs(37, 4, 29, 16, seed=3)
    whole = attention.sink_attention(q, kv, bias, sink, 0.25)
    monkeypatch.setattr(attention, "SCORE_BLOCK_ELEMENTS", 4 * 30 * 5)      # blocks of 5 rows
    blocked = attention.sink_attention(q, kv, bias, sink, 0.25)
    torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
    # each row alone (the independence the blocking relies on)
    one = torch.cat([attention.sink_attention(q[i:i + 1], kv, bias[i:i + 1], sink, 0.25) for i in range(37)])
    torch.testing.assert_close(one, whole, rtol=1e-6, atol=1e-6)


def test_sparse_version_matches_shared_keys():
    """Every row naming the visible keys of the shared list as its index list gives the shared result."""
    q, kv, bias, sink = _inputs(6, 4, 11, 8, seed=5)
    shared = attention.sink_attention(q, kv, bias, sink, 0.3)
    index = torch.where(bias == 0, torch.arange(11), -1)
    rows = attention.sparse_sink_attention(q, [(kv, index)], sink, 0.3)
    torch.testing.assert_close(rows, shared, rtol=1e-6, atol=1e-6)
