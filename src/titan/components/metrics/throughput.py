"""Peak FLOP/s of the device in the run's compute dtype (a table for GPUs, the best measurement so far on CPUs)
and peak memory."""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import sys
from time import perf_counter

import torch

from titan.components.data.tokenizer import cache_dir
from titan.tools.agreement import locked

# Dense bf16/fp16 peak TFLOP/s (no sparsity) by device-name fragment, most specific first.
GPU_PEAK_BF16_TFLOPS = [
    ("GB200", 2500.0), ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("H20", 148.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 125.0), ("MI300X", 1307.0), ("MI250X", 383.0),
]


def gpu_peak_tflops(name: str) -> float | None:
    for fragment, peak in GPU_PEAK_BF16_TFLOPS:
        if fragment in name:
            return peak
    return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


CPU_PEAK_SIZES = (256, 1024, 2048, 3072)
"""Square matmul sizes of a CPU peak measurement (AMX peaks between 1024 and 4096; bf16 on a CPU without bf16
units is emulated, far slower than fp32, and stops after the small ones, see the time budget)."""


def measure_matmul_peak_tflops(device: torch.device | str = "cpu", sizes: tuple[int, ...] = CPU_PEAK_SIZES,
                               repeats: int = 5, budget_s: float = 3.0,
                               dtype: torch.dtype = torch.bfloat16) -> dict[int, float]:
    """Best `dtype` matmul TFLOP/s per size on `device` (this process's threads on a CPU), random operands.

    Best of `repeats` timed products after one warm-up, per size: interference from other jobs only ever slows a
    product down, so the fastest one is the closest to what the hardware can do. Sizes go up while the
    products predicted from the rate so far fit in `budget_s`; the first size is always measured.
    """
    device = torch.device(device)
    rates: dict[int, float] = {}
    start = perf_counter()
    for n in sizes:
        if rates and (repeats + 1) * 2 * n**3 / max(rates.values()) / 1e12 > budget_s - (perf_counter() - start):
            break
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        best = float("inf")
        for i in range(repeats + 1):
            _sync(device)
            t0 = perf_counter()
            a @ b
            _sync(device)
            elapsed = perf_counter() - t0
            if i:  # the first product pays for allocation, packing and (on CUDA) the library's set-up
                best = min(best, elapsed)
        rates[n] = 2 * n**3 / best / 1e12
    return rates


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_peak_tflops(dtype: torch.dtype = torch.bfloat16) -> float:
    """The best `dtype` matmul rate this CPU model and thread count has shown: measured once per process, thread
    count and dtype, and the cache keeps the maximum over runs, so a measurement taken while other jobs load the
    machine (too low, which would inflate MFU) gives way to the next better one. The dtype is the run's compute
    dtype: on a CPU that emulates bf16, an fp32 run measured against the bf16 peak would read far above 100%."""
    return _best_cpu_peak_tflops(cpu_peak_key(dtype), dtype)


def cpu_peak_key(dtype: torch.dtype = torch.bfloat16) -> str:
    """The cache's key: the CPU model, the thread count, the torch release (its matmul kernels) and the dtype."""
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{_cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}|{dtype_name}"


@functools.cache
def _best_cpu_peak_tflops(key: str, dtype: torch.dtype) -> float:
    path = cache_dir() / "cpu_peak_tflops.json"
    measured = max(measure_matmul_peak_tflops(dtype=dtype).values())
    with locked(path.parent):  # ranks of one job, and jobs sharing the folder, merge their figures in turn
        try:
            table = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            table = {}
        table = table if isinstance(table, dict) else {}
        if measured > table.get(key, 0.0):
            table[key] = measured
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
    return float(table[key])


def cpu_has_bf16_units() -> bool:
    """AVX512-BF16 or AMX: without either, bf16 matmuls are emulated."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def device_peak_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16,
                       configured_cpu_peak: float = 0.0) -> float | None:
    """The peak MFU divides by, in the run's compute dtype; None (MFU n/a) for a GPU not in the table, for fp32
    on a GPU (its peak depends on TF32 settings the table does not know), and for half precision on a CPU that
    emulates it: the emulation speeds up with size past what the time budget measures (a debug run read well
    above 100%), so no measured figure is a peak."""
    if device.type == "cuda":
        return gpu_peak_tflops(torch.cuda.get_device_name(device)) if dtype != torch.float32 else None
    if configured_cpu_peak:
        return configured_cpu_peak
    if dtype != torch.float32 and not cpu_has_bf16_units():
        return None
    return cpu_peak_tflops(dtype)


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    kib = 1 / 1024 if sys.platform == "darwin" else 1  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 2**20


if __name__ == "__main__":
    # `python -m titan.components.metrics.throughput`: measure the CPU peaks again (best of this and the cache).
    for measured_dtype in (torch.bfloat16, torch.float32):
        print(f"matmul peak, {cpu_peak_key(measured_dtype)}: {cpu_peak_tflops(measured_dtype):.3f} TFLOP/s "
              f"(best so far, kept in {cache_dir() / 'cpu_peak_tflops.json'})")
