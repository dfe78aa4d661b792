"""The op table: every op's implementation in each backend set, as a lazy path, and the one call its entry point
makes.

Each op's entry point (e.g. `kernels.matmul.linear`) calls `call(op)`: whatever the *active* table
(kernels/table.py) maps it to, the `reference` implementation while none is active. A table is built from a
backend-set name once, when the engine is built (`LLM(kernel_backend=...)`), and made active around each forward
(`table.use`), so model code calls ops and never asks which mode it runs in.

Backend sets:
  reference   plain torch, the oracle every other backend is checked against
  invariant   fixed reduction order: every row-mixing op runs on fixed tiles of rows (kernels/tiles.py), so a
              row's bits do not depend on what shares its batch (DEEPINFER_BATCH_INVARIANT=1 selects it)
  triton      Triton GPU kernels (CUDA, sm_90 first): fused, quantized-weight-native, no host sync
  triton_invariant  Triton kernels with one fixed tile configuration whatever the rows (no split that depends
              on M), for batch-invariant mode
An op without an implementation in the chosen set runs the first one it has along the set's FALLBACK chain
(a set lists what it overrides); `KernelTable.backends` records the choice per op, which result rows carry.

OPS names each implementation as "module:function" inside deepinfer.kernels, `<op family>.py` for the torch ones
and `<op family>_triton.py` for the Triton ones. Nothing is imported until an implementation is first called
(`load`), and a `*_triton` path counts only where the triton package is installed (found, not imported), so
importing the op table or building a KernelTable imports no Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

BACKEND_SETS = ("reference", "invariant", "triton", "triton_invariant")
FALLBACK = {                     # set -> the sets whose implementations stand in, in order, for ops it lacks
    "reference": (),
    "invariant": ("reference",),
    "triton": ("reference",),
    "triton_invariant": ("invariant", "reference"),
}
INVARIANT_OF = {"reference": "invariant", "invariant": "invariant", "triton": "triton_invariant",
                "triton_invariant": "triton_invariant"}             # a set's batch-invariant partner
DEFAULT_OF = {"reference": "reference", "invariant": "reference", "triton": "triton",
              "triton_invariant": "triton"}                         # and back


def _torch_paths(module: str, reference: str, invariant: str | None = None) -> dict[str, str]:
    paths = {"reference": f"{module}:{reference}"}
    if invariant is not None:
        paths["invariant"] = f"{module}:{invariant}"
    return paths


def _triton_paths(module: str, default: str, invariant: str | None = None) -> dict[str, str]:
    """Both Triton sets; one function serves both where its result is batch-invariant as it is."""
    return {"triton": f"{module}:{default}", "triton_invariant": f"{module}:{invariant or default}"}


OPS: dict[str, dict[str, str]] = {   # op -> backend set -> "module:function"
    "sink_attention": _torch_paths("attention", "_sink_attention"),
    "sparse_sink_attention": {**_torch_paths("attention", "_sparse_sink_attention", "_sparse_sink_attention_tiles"),
                              **_triton_paths("attention_triton", "sparse_sink_attention_triton",
                                        "sparse_sink_attention_triton_invariant")},
    "grouped_experts": {**_torch_paths("experts", "_reference", "_invariant"),
                        **_triton_paths("experts_triton", "_triton", "_triton_invariant")},
    "swiglu": {**_torch_paths("experts", "_swiglu"), **_triton_paths("experts_triton", "swiglu_triton")},
    "qat_fp8": {**_torch_paths("fake_quant", "_qat_fp8"), **_triton_paths("fake_quant_triton", "qat_fp8_triton")},
    "qat_fp4": {**_torch_paths("fake_quant", "_qat_fp4"), **_triton_paths("fake_quant_triton", "qat_fp4_triton")},
    "qat_index": {**_torch_paths("fake_quant", "_qat_index"), **_triton_paths("fake_quant_triton", "qat_index_triton")},
    "act_quant_fp8": {**_torch_paths("fp8_linear", "_act_quant_ref"), **_triton_paths("fp8_linear_triton", "_act_quant_triton")},
    "fp8_linear": {**_torch_paths("fp8_linear", "_fp8_linear_ref", "_fp8_linear_tiles"),
                   **_triton_paths("fp8_linear_triton", "_fp8_linear_triton", "_fp8_linear_triton_invariant")},
    "index_scores": _torch_paths("indexer", "_index_scores"),
    "sparse_index_scores": {**_torch_paths("indexer", "_sparse_index_scores", "_sparse_index_scores_tiles"),
                            **_triton_paths("indexer_triton", "sparse_index_scores_triton",
                                      "sparse_index_scores_triton_invariant")},
    "top_k_indices": {**_torch_paths("indexer", "_top_k_indices"), **_triton_paths("indexer_triton", "top_k_indices_triton")},
    "kv_pack": {**_torch_paths("kv_formats", "_kv_pack"), **_triton_paths("kv_formats_triton", "kv_pack_triton")},
    "linear": {**_torch_paths("matmul", "_linear", "_linear_tiles"),
               "triton_invariant": "matmul_triton:linear_invariant"},        # weights once per 64 rows
    "linear_f32": {**_torch_paths("matmul", "_linear_f32", "_linear_f32_tiles"),
                   "triton": "matmul:_linear_f32_mixed"},           # cuBLAS with an fp32 output, no Triton
    "grouped_linear": {**_torch_paths("matmul", "_grouped", "_grouped_tiles"),
                       "triton_invariant": "matmul_triton:grouped_linear_invariant"},
    "hc_mixes": {**_torch_paths("mhc", "_hc_mixes", "_hc_mixes_tiles"),
                 **_triton_paths("mhc_triton", "hc_mixes_triton", "hc_mixes_triton_invariant")},
    "hc_collapse": {**_torch_paths("mhc", "_hc_collapse", "_hc_collapse_tiles"),
                    **_triton_paths("mhc_triton", "hc_collapse_triton", "hc_collapse_triton_invariant")},
    "hc_post": {**_torch_paths("mhc", "_hc_post", "_hc_post_tiles"),
                **_triton_paths("mhc_triton", "hc_post_triton", "hc_post_triton_invariant")},
    "hc_head": _torch_paths("mhc", "_hc_head", "_hc_head_tiles"),
    "moe_combine": {**_torch_paths("moe_combine", "_reference"), **_triton_paths("moe_combine_triton", "_triton")},
    "rms_norm": {**_torch_paths("norm", "_rms_norm", "_rms_norm_tiles"),
                 **_triton_paths("norm_triton", "rms_norm_triton", "rms_norm_triton_invariant")},
    "rope": {**_torch_paths("rope", "_rope"), **_triton_paths("rope_triton", "rope_triton")},
    "rope_angles": {**_torch_paths("rope", "_rope_angles"), **_triton_paths("rope_triton", "rope_angles_triton")},
    "route": {**_torch_paths("routing", "_route_reference", "_route_tiles"),
              **_triton_paths("routing_triton", "_route_triton_default", "_route_triton_invariant")},
    "permute": {**_torch_paths("routing", "_permute_reference"), **_triton_paths("routing_triton", "_permute_triton")},
    "rowwise": _torch_paths("rowwise", "_plain", "_tiles"),
    "gumbel_argmax": {**_torch_paths("sampling", "_reference"), **_triton_paths("sampling_triton", "_triton")},
    "softmax_pool": {**_torch_paths("softmax_pool", "_softmax_pool", "_softmax_pool_tiles"),
                     **_triton_paths("softmax_pool_triton", "softmax_pool_triton")},
    "ring_index": {**_torch_paths("step_index", "_ring_index"), **_triton_paths("step_index_triton", "ring_index_triton")},
    "ring_slots": {**_torch_paths("step_index", "_ring_slots"), **_triton_paths("step_index_triton", "ring_slots_triton")},
    "entry_slots": {**_torch_paths("step_index", "_entry_slots"),
                    **_triton_paths("step_index_triton", "entry_slots_triton")},
    "entry_index": {**_torch_paths("step_index", "_entry_index"),
                    **_triton_paths("step_index_triton", "entry_index_triton")},
    "gather_rows": {**_torch_paths("gather", "_gather_rows"), **_triton_paths("gather_triton", "gather_rows_triton")},
    "entry_pick": {**_torch_paths("step_index", "_entry_pick"), **_triton_paths("step_index_triton", "entry_pick_triton")},
}


class KernelBackendError(ValueError):
    """An unknown backend-set name (the engine turns it into one error line)."""


def triton_installed() -> bool:
    """Whether the triton package can be imported here, found without importing it."""
    return importlib.util.find_spec("triton") is not None


def implemented(op: str) -> dict[str, str]:
    """The backend sets that implement `op` here -> their paths (the `*_triton` ones only where triton is
    installed: their kernels need it)."""
    with_triton = triton_installed()
    return {backend: path for backend, path in OPS[op].items()
            if with_triton or not path.partition(":")[0].endswith("_triton")}


_LOADED: dict[str, Callable] = {}     # path -> function, filled on first use


def load(path: str) -> Callable:
    """The function a "module:function" path names (importing its module on first use)."""
    fn = _LOADED.get(path)
    if fn is None:
        module, _, name = path.partition(":")
        fn = _LOADED[path] = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return fn


_active = None          # the KernelTable in use (kernels/table.py sets it), None: every op's reference


def call(op: str) -> Callable:
    table = _active
    return table.fns[op] if table is not None else load(OPS[op]["reference"])
