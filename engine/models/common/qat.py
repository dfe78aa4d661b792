"""Quantization-aware steps of DeepSeek's V4 reference that are part of the model math.

transformers leaves them out; `qat_fake_quant=False` turns them off so parity tests compare like
with like. See docs/quantization.md for the reference behaviour each one reproduces.
"""

import torch

from deepinfer.kernels.kv_formats import KVFormat
from deepinfer.kernels.fake_quant import qat_index, qat_fp8

KV_FP8_BLOCK = 64      # the K=V latent's non-RoPE channels: FP8 e4m3, one ue8m0 scale per 64
INDEX_FP4_BLOCK = 32   # indexer q and k: Hadamard rotation, then FP4 e2m1, one ue8m0 scale per 32


def quantize_kv_latent(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x: [..., d]; the trailing RoPE slice stays in the compute dtype."""
    return torch.cat([qat_fp8(x[..., :-rope_dim], KV_FP8_BLOCK), x[..., -rope_dim:]], dim=-1)


def quantize_index(x: torch.Tensor) -> torch.Tensor:
    """x: [..., dI] indexer query or key."""
    return qat_index(x, INDEX_FP4_BLOCK)


def latent_record(head_dim: int, rope_dim: int) -> KVFormat | None:
    """The release's FP8 cache record of a K=V latent (window and compressed entries): the non-RoPE channels e4m3
    per 64 with ue8m0 scales, the RoPE slice bf16 (584 B at 512 / 64)."""
    return KVFormat.fitting("fp8", head_dim, KV_FP8_BLOCK, tail=rope_dim)


def index_record(index_dim: int) -> KVFormat | None:
    """The cache record of an indexer key: FP4 e2m1 per 32 with ue8m0 scales (68 B at 128)."""
    return KVFormat.fitting("fp4", index_dim, INDEX_FP4_BLOCK)
