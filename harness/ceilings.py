"""Device ceilings measured in the run that uses them (docs/bench.md, `deepinfer-bench step`), and the roofline.

  copy      one large device-to-device copy (dst.copy_(src)); bandwidth = (bytes read + bytes written) / time,
            i.e. 2 x size / time, the convention of the project's earlier H200 numbers ("device-to-device copy
            about 4.3 TB/s (read+write)") and of nvbandwidth's device-local copy
  gemm      torch.mm of two n x n matrices in a dtype: 2 n^3 / time, in the model's compute dtype (the roofline's)
            and in bfloat16 (on CPU only when that is the compute dtype: CPU bf16 GEMMs are slow to measure)
  fp8       torch._scaled_mm of two n x n float8_e4m3fn matrices (unit scales, bf16 out): 2 n^3 / time; CUDA
            only (None elsewhere, or where this torch / GPU has no fp8 GEMM)

Times: warm-up calls, then timed calls (CUDA events on a GPU, perf_counter on CPU); the value is the median
call. Roofline of a step: max(bytes / copy bandwidth, flops / GEMM peak of the compute dtype)."""

from __future__ import annotations

import statistics
import time

import torch

# (copy bytes, GEMM n, warm-up calls, timed calls)
CUDA_SIZES = (1 << 30, 8192, 3, 10)
CPU_SIZES = (32 << 20, 512, 2, 5)


def time_calls(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of one fn() call."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in pairs:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        return statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int, warmup: int, iters: int) -> float:
    """(read + write) bytes per second of a device-to-device copy of nbytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = time_calls(lambda: dst.copy_(src), device, warmup, iters)
    del src, dst
    return 2 * nbytes / t


def gemm_flops(device: torch.device, dtype: torch.dtype, n: int, warmup: int, iters: int) -> float:
    """FLOP/s of torch.mm on n x n matrices of dtype."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    out = torch.empty(n, n, device=device, dtype=dtype)
    t = time_calls(lambda: torch.mm(a, b, out=out), device, warmup, iters)
    return 2 * n ** 3 / t


def fp8_flops(device: torch.device, n: int, warmup: int, iters: int) -> tuple[float | None, str | None]:
    """(FLOP/s of torch._scaled_mm e4m3 x e4m3 -> bf16, None) or (None, why not)."""
    if device.type != "cuda":
        return None, "fp8 GEMM is measured on CUDA only"
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return None, f"torch {torch.__version__} has no float8_e4m3fn / _scaled_mm"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device, generator=gen).to(torch.float8_e4m3fn).t()   # column-major
        one = torch.ones((), device=device, dtype=torch.float32)
        t = time_calls(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                        device, warmup, iters)
    except (RuntimeError, TypeError) as e:     # no fp8 tensor cores (pre-sm89) or an older signature
        return None, f"torch._scaled_mm failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return 2 * n ** 3 / t, None


def measure_ceilings(device: str | torch.device, compute_dtype: torch.dtype) -> dict:
    """Every ceiling of this device, once. Keys: copy_bytes_per_s, gemm_flops_per_s (compute dtype),
    gemm_bf16_flops_per_s (None on CPU unless bf16 is the compute dtype), fp8_flops_per_s (None off CUDA), and
    how each was measured."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    nbytes, n, warmup, iters = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    with torch.inference_mode():
        bw = copy_bandwidth(device, nbytes, warmup, iters)
        compute = gemm_flops(device, compute_dtype, n, warmup, iters)
        bf16 = compute if compute_dtype == torch.bfloat16 else \
            gemm_flops(device, torch.bfloat16, n, warmup, iters) if device.type == "cuda" else None
        fp8, fp8_note = fp8_flops(device, n, warmup, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes_per_s": bw, "gemm_flops_per_s": compute, "gemm_dtype": str(compute_dtype).split(".")[-1],
            "gemm_bf16_flops_per_s": bf16, "fp8_flops_per_s": fp8, "fp8_note": fp8_note,
            "method": {"copy_bytes": nbytes, "copy_counts": "read+write (2 x size / time)", "gemm_n": n,
                       "warmup": warmup, "iters": iters, "statistic": "median call"}}


def roofline(total_bytes: float, total_flops: float, bytes_per_s: float, flops_per_s: float) -> dict:
    """Roofline time of a step: the larger of its memory time and its compute time (ms), and which bounds it."""
    memory_ms = 1e3 * total_bytes / bytes_per_s
    compute_ms = 1e3 * total_flops / flops_per_s
    return {"roofline_ms": max(memory_ms, compute_ms), "roofline_memory_ms": memory_ms,
            "roofline_compute_ms": compute_ms, "bound": "memory" if memory_ms >= compute_ms else "compute"}
