"""The rates of the kernels published large-EP deployments ran (DeepGEMM, FlashMLA), as their authors published them
(data/anchors.json "kernel_rates"), scaled to another GPU by hardware.json's ratio of that GPU's rates to the
publishing GPU's (docs/projection.md, "Validation").

A kernel's rows give the FLOP rate and the byte rate it achieved at a shape (m rows, n x k weights). A call is timed
at max(bytes / byte rate, FLOPs / FLOP rate), both rates interpolated in log2(m) between the rows of its (n, k): at
a published shape that is the published time. A shape outside the rows takes the nearest row's rates, said in the
flags; an (n, k) without rows takes the rows of the nearest weight size, said too. A kernel with `ceilings` runs at
the GPU's measured copy and GEMM ceilings (no published figure: the data file says so)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.errors import DeepInferError

from .hardware import Profile

RATE_FIELDS = ("m", "n", "k", "tflops", "gbps")


@dataclass(frozen=True)
class Rate:
    """Achieved rates of one call on the target GPU."""
    flops_per_s: float
    bytes_per_s: float
    flags: tuple[str, ...] = ()

    def time_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


@dataclass(frozen=True)
class Kernel:
    name: str
    gpu: str                                   # the GPU its figures were published on
    flops_dtype: str                           # "fp8" | "bf16": which GEMM ceiling scales its FLOP rate
    rows: tuple[tuple[float, ...], ...]        # (m, n, k, tflops, gbps)
    ceilings: bool
    source: str

    def rate(self, m: float, n: int, k: int, target: Profile, published_on: Profile) -> Rate:
        """The rates of an (m x k) @ (k x n) call on `target`."""
        flops_key = f"{self.flops_dtype}_flops_per_s"
        if self.ceilings:
            return Rate(getattr(target, flops_key), target.memory_bytes_per_s)
        tflops, gbps, flags = self._published(m, n, k)
        # the publishing GPU's rates -> the target's, by hardware.json's measured ratio (1 on the same GPU)
        return Rate(tflops * 1e12 * getattr(target, flops_key) / getattr(published_on, flops_key),
                    gbps * 1e9 * target.memory_bytes_per_s / published_on.memory_bytes_per_s, flags)

    def _published(self, m: float, n: int, k: int) -> tuple[float, float, tuple[str, ...]]:
        flags = []
        shapes = sorted({(r[1], r[2]) for r in self.rows})
        nk = (n, k)
        if shapes == [(0, 0)]:               # peaks, not one shape (FlashMLA's README)
            nk = (0, 0)
        elif nk not in shapes:               # the published shape of the nearest weight size
            nk = min(shapes, key=lambda s: abs(math.log(s[0] * s[1] / (n * k))))
            flags.append(f"{self.name}: ({n}, {k}) not published, the rates of ({nk[0]}, {nk[1]})")
        rows = sorted((r for r in self.rows if (r[1], r[2]) == nk), key=lambda r: r[0])
        ms = [r[0] for r in rows]
        if len(rows) == 1 or m <= ms[0] or m >= ms[-1]:
            row = rows[0] if len(rows) == 1 or m <= ms[0] else rows[-1]
            if len(rows) > 1 and m != row[0]:
                flags.append(f"{self.name}: m {m:g} outside the published {ms[0]:g}-{ms[-1]:g}, m {row[0]:g}'s rates")
            return row[3], row[4], tuple(flags)
        hi = next(i for i, x in enumerate(ms) if x >= m)
        lo = hi - 1
        w = (math.log2(m) - math.log2(ms[lo])) / (math.log2(ms[hi]) - math.log2(ms[lo]))
        return ((1 - w) * rows[lo][3] + w * rows[hi][3], (1 - w) * rows[lo][4] + w * rows[hi][4], tuple(flags))


def kernels(data: dict) -> dict[str, Kernel]:
    """anchors.json's "kernel_rates" -> Kernel by name; one line naming what a malformed entry lacks."""
    out = {}
    for name, k in data.items():
        missing = [f for f in ("gpu", "flops_dtype", "source") if f not in k]
        if not k.get("ceilings") and "rows" not in k:
            missing.append("rows")
        if missing:
            raise DeepInferError(f"anchors.json: kernel_rates.{name} lacks {missing}")
        if k["flops_dtype"] not in ("fp8", "bf16"):
            raise DeepInferError(f"anchors.json: kernel_rates.{name}: flops_dtype {k['flops_dtype']!r}, use fp8 or "
                                 f"bf16")
        if k.get("columns", list(RATE_FIELDS)) != list(RATE_FIELDS):
            raise DeepInferError(f"anchors.json: kernel_rates.{name}: columns must be {list(RATE_FIELDS)}")
        rows = tuple(tuple(r) for r in k.get("rows", ()))
        if any(len(r) != len(RATE_FIELDS) or r[3] <= 0 or r[4] <= 0 for r in rows):
            raise DeepInferError(f"anchors.json: kernel_rates.{name}: every row is [m, n, k, tflops > 0, gbps > 0]")
        out[name] = Kernel(name, k["gpu"], k["flops_dtype"], rows, bool(k.get("ceilings")), k["source"])
    return out
