"""Engram tables in host memory (LLM(..., engram_table_device="cpu")): a V4.1-Flash engram table is large and a token
reads only a few of its rows (one per n-gram order and head), so the tables can live in host memory (pinned when
the model runs on a GPU) while every other weight stays on the device. Each forward gathers the rows its batch
hashed to on the host and copies just those to the device: the same gather (`embedding`) over the same values,
so the outputs are those of on-device tables (bitwise on a CPU run, where both gathers are the same op).

Costs: the hash ids go to the host and the rows back every forward (a host sync per engram layer), so a model
with host tables runs eagerly (no CUDA graphs: engine/llm.py turns them off)."""

from __future__ import annotations

import torch
from torch import nn

from ...errors import DeepInferError
from .engram import EngramEmbedding


class HostEngramEmbedding(EngramEmbedding):
    """An engram table that stays in host memory whatever device the model is moved to or materialized on."""

    def __init__(self, num_embeddings: int, head_dim: int, dtype: torch.dtype, pin: bool,
                 values: torch.Tensor | None = None):
        nn.Module.__init__(self)
        self.num_embeddings, self.head_dim, self.pin = num_embeddings, head_dim, pin
        if values is None or values.is_meta:        # build_model's meta model: materialized on the host by _apply
            table = torch.empty(num_embeddings, head_dim, dtype=dtype, device="meta")
        else:
            table = self._host_empty(values.shape, dtype).copy_(values)
        self.weight = nn.Parameter(table, requires_grad=False)

    def _host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self.pin)

    def _apply(self, fn, recurse: bool = True):
        # to_empty / .to(device) leave the table on the host (its place); a meta table is allocated there
        if self.weight.is_meta:
            self.weight = nn.Parameter(self._host_empty(self.weight.shape, self.weight.dtype), requires_grad=False)
        return self

    def forward(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """hash ids [..., C] (any device) -> rows [..., C, head_dim] on the ids' device, gathered on the host."""
        rows = nn.functional.embedding(hash_ids.to(self.weight.device), self.weight)
        return rows.to(hash_ids.device)


def host_engram_tables(device: str, engram_table_device) -> bool:
    """LLM / load_model's engram_table_device -> whether the tables go to host memory; one line when unusable."""
    if engram_table_device is None or engram_table_device == device:
        return engram_table_device == "cpu"
    if engram_table_device != "cpu":
        raise DeepInferError(f"engram_table_device={engram_table_device!r}: use 'cpu' (the tables in host memory) or "
                             f"None (on the model's device, {device})")
    return True


def keep_engram_tables_on_host(model: nn.Module, pin: bool) -> None:
    """Every engram table of `model` (built or still on the meta device) becomes a HostEngramEmbedding holding the
    same values; pin: page-locked memory (a GPU model's tables, for faster row copies)."""
    tables = [(name, m) for name, m in model.named_modules() if type(m) is EngramEmbedding]
    if not tables:
        raise DeepInferError("engram_table_device='cpu' keeps a V4.1 model's engram tables in host memory; this model "
                             "has no engram layers: drop engram_table_device")
    for name, table in tables:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, HostEngramEmbedding(
            table.num_embeddings, table.head_dim, table.weight.dtype, pin, table.weight.detach()))
