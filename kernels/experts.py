"""Routed-expert compute: `grouped_experts`, one SwiGLU MLP per expert over rows already grouped by expert.

The MoE (engine/models/moe.py) routes, the dispatcher (engine/parallel/dispatch.py) permutes the rows so each
expert's rows are contiguous, this op runs every row through its expert, and the dispatcher's combine sums each
row's k outputs back. Per sorted row j (expert e = expert_ids[j], routing weight r = route_weights[j]):

    y[j] = w2[e] (r * swiglu(w1[e] x[j], w3[e] x[j], limit))        (the weight applied before w2, as DeepSeek)

w1 x and w3 x are GEMMs in the compute dtype; swiglu and the routing-weight product in >= fp32 (upcast); the
product is cast back to the compute dtype for w2, and y is returned in >= fp32 (float64 stays float64).

How a backend computes is its own choice from the shapes (and device) it is given, never a mode set by a caller:

reference
  CPU            each expert's rows as one GEMM, offsets read on the host (no device to wait for): the math and
                 bits of the per-expert loop the model used before this op.
  CUDA, few rows (rows * GATHER_FRACTION <= experts): each row gathers its own expert's weights (bmm of [1, D]
                 rows), reading at most the routed experts' weights; static shapes, no host sync.
  CUDA, bf16     torch._grouped_mm over all groups at once (native sm90 kernel; offsets stay on the device).
                 FP4 weights are dequantized in chunks of experts (GROUPED_CHUNK_BYTES), each chunk's rows
                 rotated to the front so its groups start at row 0.
  CUDA, else     (fp32 / float64, unaligned dims, no _grouped_mm) expert-aligned row tiles, as `invariant` below;
                 above PER_EXPERT_ROWS rows (prefill, eager) expert by expert as on CPU.
invariant
  every row gets one fixed computation whatever shares its batch, and the output equals reference up to rounding:
  CPU            each expert's rows in fixed tiles of TILE rows (kernels/tiles.py), offsets read on the host.
  CUDA           expert-aligned tiles: each expert's rows are cut into tiles of TILE rows (zero-padded), every
                 tile holds rows of one expert, and tiles go through bmm in batches of a fixed count: every GEMM
                 has one shape whatever the batch, no host sync, static shapes for a given number of rows
                 (tiles <= rows/TILE + min(rows, experts)). Weights are gathered per tile.

Weights: `ExpertWeights`, dense stacks in the compute dtype or the checkpoint's FP4 (packed e2m1 uint8
[E, out, in/2] + e8m0 uint8 scales [E, out, in/32]), dequantized inside the op only for the experts (or chunk
of experts) being computed (`dequantize_fp4_fast`: quant.dequantize_fp4's bits).

Numerics: every formulation is the same math, rounded differently only in GEMM blocking. Measured against a
per-row float64 reference (tests/test_kernels_experts.py; docs/model.md "MoE"): float64 <= 2e-15, fp32 <= 1e-6
(CPU) / 4e-7 (H200), bf16 <= 6e-3 of the output's max magnitude."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .precision import upcast
from .quant import e2m1_decode, e8m0_to_float, fake_quant_fp8
from .registry import call
from .tiles import TILE, row_tiles

FP4_BLOCK = 32                 # e2m1 values per e8m0 scale, along K
FP8_W_BLOCK = 128              # FP8 expert weights: one scale per 128x128 block
FP8_ACT_BLOCK = 128            # FP8 activations: one power-of-two scale per 1x128 block along K
GATHER_FRACTION = 4            # reference on CUDA: rows gather their own experts when rows * 4 <= experts
GATHER_BYTES = 1 << 30         # reference on CUDA, gathered: at most this many bytes of gathered w1+w3+w2 at once
GROUPED_CHUNK_BYTES = 1 << 30  # reference on CUDA, FP4: at most this many bytes of dequantized w1+w3+w2 at once
REFERENCE_TILE = 64            # reference on CUDA, fallback: rows per expert-aligned tile
PER_EXPERT_ROWS = 4096         # reference on CUDA, fallback: above this many rows (never graph-captured) per expert
TILE_BATCH_BYTES = 1 << 28     # expert-aligned tiles: gathered weight bytes (w1 + w3 + w2) per bmm batch
MAX_TILE_BATCH = 16
GROUPED_MM_DTYPES = (torch.bfloat16,)   # torch._grouped_mm's native CUDA kernel (others fall back with a sync)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(gate clamped above at limit) * (up clamped to +-limit), gate, up [N, I] -> [N, I] in >= fp32 (the
    references upcast both branches). limit <= 0: no clamp. An op (a dense MLP's activation, the shared experts');
    the grouped expert paths below call the reference directly."""
    return call("swiglu")(gate, up, limit)


def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = upcast(gate), upcast(up)
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ExpertWeights:
    """The routed experts of one layer, stacked: w1, w3 [E, I, D] and w2 [E, D, I], in one of three formats:

    dense  w* in `dtype`, `scales` None
    fp4    w* packed e2m1 uint8 [E, out, in/2] (low nibble = even element), scales e8m0 uint8 [E, out, in/32]
    fp8    w* float8_e4m3fn [E, out, in], scales float32 [E, ceil(out/128), ceil(in/128)] (128x128 blocks)

    layout "hopper_mx" (fp4 only): the same buffers hold the bytes in triton_kernels' Hopper MX layouts (same shapes
    and sizes, kernels/experts_ogs.py); `get` reads them back per call, so every backend takes either layout.

    act_fp8 selects the numerics of the GEMM inputs: False (W4A16 / W8A16 / dense): activations in `dtype`;
    True (W4A8 / W8A8, DeepSeek's inference recipe): each GEMM's activations (x, then the SwiGLU output h rounded to
    `dtype`) quantized per 1x128 block to e4m3 with a power-of-two scale (quant.fake_quant_fp8), fp32 accumulation."""

    w1: torch.Tensor
    w2: torch.Tensor
    w3: torch.Tensor
    dtype: torch.dtype            # the compute dtype (activations between the GEMMs, dense / dequantized weights)
    limit: float                  # swiglu_limit; <= 0: no clamp
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # (w1, w2, w3) for fp4 / fp8
    act_fp8: bool = False
    layout: str = "rows"          # fp4 bytes as above ("rows") or rearranged in the same buffers for
                                  # triton_kernels' Hopper decode ("hopper_mx", kernels/experts_ogs.py)

    def __post_init__(self):
        if self.layout not in ("rows", "hopper_mx") or (self.layout != "rows" and self.fmt != "fp4"):
            raise ValueError(f"expert weight layout {self.layout!r}: 'rows', or 'hopper_mx' for FP4 weights")
        if self.act_fp8 and self.scales is None:
            raise ValueError("FP8 activations (W4A8 / W8A8) need FP4 or FP8 expert weights; dense weights run in "
                             "the compute dtype")
        if self.act_fp8 and (self.dim % FP8_ACT_BLOCK or self.inter % FP8_ACT_BLOCK):
            raise ValueError(f"FP8 activations need dim and moe_intermediate_size multiples of {FP8_ACT_BLOCK}; "
                             f"got {self.dim} and {self.inter}")

    @property
    def fmt(self) -> str:
        if self.scales is None:
            return "dense"
        return "fp8" if self.w1.dtype == torch.float8_e4m3fn else "fp4"

    @property
    def fp4(self) -> bool:
        return self.fmt == "fp4"

    @property
    def n_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def dim(self) -> int:
        return self.w2.shape[1]

    @property
    def inter(self) -> int:
        return self.w1.shape[1]

    @property
    def gemm_dtype(self) -> torch.dtype:
        """The dtype the reference GEMMs run in: `dtype`; with FP8 activations one whose inputs hold the recipe's
        operands exactly: bf16 for FP4 weights in a bf16 model (e4m3 x 2^k and e2m1 x 2^k are bf16 values; the
        GEMM accumulates in fp32), else >= fp32 (an FP8 weight times its fp32 block scale needs fp32)."""
        if not self.act_fp8:
            return self.dtype
        if self.fmt == "fp4" and self.dtype == torch.bfloat16:
            return torch.bfloat16
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def gemm_in(self, t: torch.Tensor) -> torch.Tensor:
        """A GEMM's activations as the recipe feeds them: rounded to `dtype`, then (act_fp8) FP8 per 1x128."""
        t = t.to(self.dtype)
        return fake_quant_fp8(t, FP8_ACT_BLOCK).to(self.gemm_dtype) if self.act_fp8 else t

    def get(self, name: str, index) -> torch.Tensor:
        """Weight `name` ("w1" | "w2" | "w3") of experts `index` (an int, a slice or a tensor of ids) in
        gemm_dtype: [out, in] for an int, else stacked [n, out, in]."""
        i = "w1 w2 w3".split().index(name)
        w = (self.w1, self.w2, self.w3)[i][index]
        if self.scales is None:
            return w.to(self.gemm_dtype)
        if self.fmt == "fp8":
            return dequantize_fp8_experts(w, self.scales[i][index], self.gemm_dtype)
        s = self.scales[i][index]
        if self.layout != "rows":
            w, s = self._rows(w, s)
        return dequantize_fp4_fast(w, s, self.gemm_dtype)

    @staticmethod
    def _rows(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP4 experts held in the Hopper layout (stacked [n, out, in/2] or one [out, in/2]) -> ours."""
        from .experts_ogs import rows_of
        if w.dim() == 2:
            w, s = rows_of(w.unsqueeze(0), s.unsqueeze(0))
            return w[0], s[0]
        return rows_of(w, s)

    def bytes_per_expert(self) -> int:
        """Bytes of one expert's w1 + w3 + w2 in gemm_dtype."""
        return 3 * self.inter * self.dim * torch.empty((), dtype=self.gemm_dtype).element_size()

    def stored_bytes_per_expert(self) -> int:
        """Bytes one expert's w1 + w3 + w2 occupy as stored (weights + scales): what a kernel must read."""
        return sum(t[0].numel() * t.element_size() for t in (self.w1, self.w2, self.w3) + (self.scales or ()))


def dequantize_fp8_experts(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn [..., out, in] times its 128x128 block scales [..., ceil(out/128), ceil(in/128)] (float32),
    as quant.dequantize_fp8_blocks computes it (product in fp32, then cast) -> dtype [..., out, in]."""
    out, inp = w.shape[-2:]
    s = scale.float().repeat_interleave(FP8_W_BLOCK, dim=-2).repeat_interleave(FP8_W_BLOCK, dim=-1)
    return (w.float() * s[..., :out, :inp]).to(dtype)


def dequantize_fp4_fast(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quant.dequantize_fp4 (block 32) bit for bit, in fewer passes: one byte -> two values through a 256-entry
    table, times the block's power-of-two scale. In bf16 / fp32 each product is exact (an e2m1 value times a power
    of two, the range fp32's), so it equals the reference's fp32 product rounded; other dtypes multiply in fp32
    as the reference does. packed uint8 [..., K/2], scale e8m0 uint8 [..., K/32] -> dtype [..., K]."""
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    byte = torch.arange(256, device=packed.device)
    table = torch.stack([e2m1_decode(byte & 0xF), e2m1_decode(byte >> 4)], dim=-1).to(work)   # [256, 2]: lo, hi
    k = packed.shape[-1] * 2
    vals = table[packed.view(torch.uint8).int()].view(*packed.shape[:-1], k // FP4_BLOCK, FP4_BLOCK)
    out = (vals * e8m0_to_float(scale).to(work).unsqueeze(-1)).view(*packed.shape[:-1], k)
    return out.to(dtype)


def weight_layout(backend_set: str, device) -> str:
    """How an engine running `backend_set` on `device` should hold FP4 expert weights: "hopper_mx" for the Triton
    sets on sm_90 with triton_kernels installed (its matmul_ogs reads them there), else "rows" (ours)."""
    if backend_set not in ("triton", "triton_invariant") or torch.device(device).type != "cuda":
        return "rows"
    from .experts_ogs import HOPPER, ROWS, runs_on
    return HOPPER if runs_on(device) else ROWS


def grouped_experts(x: torch.Tensor, expert_ids: torch.Tensor, offsets: torch.Tensor, route_weights: torch.Tensor,
                    weights: ExpertWeights) -> torch.Tensor:
    """Rows grouped by expert through their experts' SwiGLU MLPs, each scaled by its routing weight before w2.

    x [M, D] (compute dtype), sorted so rows of expert e are offsets[e]:offsets[e+1]; expert_ids [M] int64
    (ascending, = the expert of each row); offsets [E+1] int64 on x's device (offsets[0] = 0, offsets[E] = M);
    route_weights [M] (fp32 / float64). Returns [M, D] >= fp32. Experts with no rows cost nothing but their
    (empty) groups."""
    return call("grouped_experts")(x, expert_ids, offsets, route_weights, weights)


# ----------------------------------------------------------------------------------------------- shared pieces

def _mlp(x: torch.Tensor, r: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
         ew: ExpertWeights) -> torch.Tensor:
    """One expert: x [m, D], r [m], w* [out, in] -> [m, D] >= fp32."""
    x = ew.gemm_in(x)
    h = _swiglu(F.linear(x, w1), F.linear(x, w3), ew.limit)
    h = h * r.unsqueeze(-1).to(h.dtype)
    return upcast(F.linear(ew.gemm_in(h), w2))


def _per_expert(x, offsets, r, ew: ExpertWeights, tile: int | None) -> torch.Tensor:
    """CPU: expert by expert with the offsets read on the host (a CPU tensor: nothing to wait for); each expert's
    rows at once (tile None) or in fixed tiles of `tile` rows."""
    out = upcast(x.new_zeros(x.shape))
    bounds = offsets.tolist()
    for e in range(ew.n_experts):
        a, b = bounds[e], bounds[e + 1]
        if a == b:
            continue
        w1, w3, w2 = ew.get("w1", e), ew.get("w3", e), ew.get("w2", e)

        def mlp(xs, rs):
            return _mlp(xs, rs, w1, w3, w2, ew)
        out[a:b] = mlp(x[a:b], r[a:b]) if tile is None else row_tiles(mlp, x[a:b], r[a:b], tile=tile)
    return out


def _gathered(x, ids, r, ew: ExpertWeights) -> torch.Tensor:
    """Each row with its own expert's weights, gathered: [m, out, in] stacks, bmm of one-row matrices, at most
    GATHER_BYTES of gathered weights at a time."""
    step = max(1, GATHER_BYTES // ew.bytes_per_expert())
    parts = []
    for a in range(0, x.shape[0], step):
        xs, e = ew.gemm_in(x[a:a + step]).unsqueeze(1), ids[a:a + step]      # [m, 1, D]
        w1, w3, w2 = ew.get("w1", e), ew.get("w3", e), ew.get("w2", e)
        h = _swiglu(torch.bmm(xs, w1.transpose(1, 2)), torch.bmm(xs, w3.transpose(1, 2)), ew.limit)
        h = h * r[a:a + step].view(-1, 1, 1).to(h.dtype)
        parts.append(upcast(torch.bmm(ew.gemm_in(h), w2.transpose(1, 2))).squeeze(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def expert_tiles(offsets: torch.Tensor, tile: int, n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-aligned tiles over rows grouped by expert, on the device (no host sync; sizes from M and E alone).

    Expert e's rows offsets[e]:offsets[e+1] fill ceil(count_e / tile) tiles of its own, in order. Returns
    (tile_start [E], tile_end [E]: expert e's tiles are tile_start[e]:tile_end[e]; tile_expert [T]: each tile's
    expert, clamped to E-1 past the last used tile), T = the static bound (M + min(M, E) * (tile - 1)) // tile."""
    n_experts = offsets.shape[0] - 1
    tiles = (offsets[1:] - offsets[:-1] + tile - 1) // tile                   # [E]
    tile_end = tiles.cumsum(0)                                                  # [E] inclusive
    n_tiles = tile_count(n_rows, n_experts, tile)
    t = torch.arange(n_tiles, device=offsets.device)
    tile_expert = torch.searchsorted(tile_end, t, right=True).clamp_(max=n_experts - 1)
    return tile_end - tiles, tile_end, tile_expert


def tile_count(n_rows: int, n_experts: int, tile: int) -> int:
    """T, the static bound on expert-aligned tiles: every row in a tile, each expert with rows wasting < a tile."""
    return max(1, (n_rows + min(n_rows, n_experts) * (tile - 1)) // tile)


def tile_layout(expert_ids: torch.Tensor, offsets: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`expert_tiles` as the torch formulation uses them: (slot [M]: padded position tile * `tile` + place of each
    sorted row, tile_expert [T], T)."""
    tile_start, _, tile_expert = expert_tiles(offsets, tile, expert_ids.shape[0])
    rank = torch.arange(expert_ids.shape[0], device=offsets.device) - offsets[expert_ids]   # place within its expert
    slot = (tile_start[expert_ids] + rank // tile) * tile + rank % tile
    return slot, tile_expert, tile_expert.shape[0]


def _tiled(x, ids, offsets, r, ew: ExpertWeights, tile: int) -> torch.Tensor:
    """Expert-aligned tiles through bmm, `batch` tiles per call (batch fixed by the weight shapes, so every
    call has one shape): routed FLOPs plus padding, weights read once per tile."""
    m, d = x.shape
    slot, tile_expert, n_tiles = tile_layout(ids, offsets, tile)
    batch = max(1, min(MAX_TILE_BATCH, TILE_BATCH_BYTES // ew.bytes_per_expert()))
    n_tiles = -(-n_tiles // batch) * batch
    tile_expert = F.pad(tile_expert, (0, n_tiles - tile_expert.shape[0]))
    xp = x.new_zeros(n_tiles * tile, d).index_copy_(0, slot, x).view(n_tiles, tile, d)
    rp = r.new_zeros(n_tiles * tile).index_copy_(0, slot, r).view(n_tiles, tile, 1)
    parts = []
    for a in range(0, n_tiles, batch):
        e = tile_expert[a:a + batch]
        xs = ew.gemm_in(xp[a:a + batch])
        w1, w3, w2 = ew.get("w1", e), ew.get("w3", e), ew.get("w2", e)
        h = _swiglu(torch.bmm(xs, w1.transpose(1, 2)), torch.bmm(xs, w3.transpose(1, 2)), ew.limit)
        h = h * rp[a:a + batch].to(h.dtype)
        parts.append(upcast(torch.bmm(ew.gemm_in(h), w2.transpose(1, 2))))
    return torch.cat(parts).view(n_tiles * tile, d).index_select(0, slot)


def _grouped_mm_ok(x: torch.Tensor, ew: ExpertWeights) -> bool:
    """torch._grouped_mm's native kernel: CUDA sm90+, bf16, 16-byte aligned rows (dims multiples of 8)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and ew.gemm_dtype in GROUPED_MM_DTYPES
            and torch.cuda.get_device_capability(x.device)[0] >= 9 and ew.dim % 8 == 0 and ew.inter % 8 == 0)


def _grouped(x, offsets, r, ew: ExpertWeights) -> torch.Tensor:
    """torch._grouped_mm, all experts at once (dense) or in chunks of experts (FP4, dequantized per chunk)."""
    m = x.shape[0]
    chunk = ew.n_experts if ew.fmt == "dense" else max(1, GROUPED_CHUNK_BYTES // ew.bytes_per_expert())
    if chunk >= ew.n_experts:
        return _grouped_chunk(x, offsets, r, ew, 0, ew.n_experts)
    out = upcast(x.new_zeros(x.shape))
    row = torch.arange(m, device=x.device)
    for c0 in range(0, ew.n_experts, chunk):
        c1 = min(ew.n_experts, c0 + chunk)
        start = offsets[c0]
        idx = (row + start) % m                                                 # the chunk's rows first
        y = _grouped_chunk(x.index_select(0, idx), offsets[c0:c1 + 1] - start, r.index_select(0, idx), ew, c0, c1)
        mine = (row < offsets[c1] - start).unsqueeze(-1)                      # rows past the chunk: not written
        out.index_copy_(0, idx, torch.where(mine, y, out.index_select(0, idx)))
    return out


def _grouped_chunk(x, offs, r, ew: ExpertWeights, c0: int, c1: int) -> torch.Tensor:
    """Experts c0..c1-1 over x whose first offs[-1] rows are theirs (offs [c1-c0+1], offs[0] = 0); rows after
    those come back unspecified."""
    ends = offs[1:].to(torch.int32)
    part = slice(c0, c1)
    w1, w3, w2 = ew.get("w1", part), ew.get("w3", part), ew.get("w2", part)
    x = ew.gemm_in(x)
    h = _swiglu(torch._grouped_mm(x, w1.transpose(1, 2), offs=ends),
               torch._grouped_mm(x, w3.transpose(1, 2), offs=ends), ew.limit)
    h = h * r.unsqueeze(-1).to(h.dtype)
    return upcast(torch._grouped_mm(ew.gemm_in(h), w2.transpose(1, 2), offs=ends))


def _empty(x: torch.Tensor) -> torch.Tensor:
    return upcast(x.new_zeros(x.shape))


# ------------------------------------------------------------------------------------------------------ backends

def _reference(x, expert_ids, offsets, route_weights, weights: ExpertWeights):
    x = x.to(weights.dtype)
    if x.shape[0] == 0:
        return _empty(x)
    if not x.is_cuda:
        return _per_expert(x, offsets, route_weights, weights, tile=None)
    if x.shape[0] * GATHER_FRACTION <= weights.n_experts:
        return _gathered(x, expert_ids, route_weights, weights)
    if _grouped_mm_ok(x, weights):
        return _grouped(x, offsets, route_weights, weights)
    if x.shape[0] > PER_EXPERT_ROWS:     # prefill-sized, eager: expert by expert (reads the offsets on the host)
        return _per_expert(x, offsets, route_weights, weights, tile=None)
    return _tiled(x, expert_ids, offsets, route_weights, weights, REFERENCE_TILE)


def _invariant(x, expert_ids, offsets, route_weights, weights: ExpertWeights):
    x = x.to(weights.dtype)
    if x.shape[0] == 0:
        return _empty(x)
    if not x.is_cuda:
        return _per_expert(x, offsets, route_weights, weights, tile=TILE)
    return _tiled(x, expert_ids, offsets, route_weights, weights, TILE)
