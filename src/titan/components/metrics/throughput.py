"""Peak FLOP/s of the device (a table for GPUs, the best measurement so far on CPUs) and peak memory."""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import sys
import time

import torch

from titan.components.data.tokenizer import cache_dir

# Dense bf16 peak TFLOP/s (no sparsity) by device-name fragment, most specific first.
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


def measure_cpu_peak_tflops(n: int = 2048, repeats: int = 5) -> float:
    """Best bf16 matmul TFLOP/s of this process's threads: the ceiling a training step could reach."""
    a = torch.randn(n, n, dtype=torch.bfloat16)
    b = torch.randn(n, n, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def cpu_peak_tflops() -> float:
    """The best rate this CPU model and thread count has shown: measured once per process and thread count, and
    the cache keeps the maximum over runs, so a measurement taken while other jobs load the machine (too low,
    which would inflate MFU) gives way to the next better one."""
    return _best_cpu_peak_tflops(f"{_cpu_name()}|threads={torch.get_num_threads()}|torch={torch.__version__}")


@functools.cache
def _best_cpu_peak_tflops(key: str) -> float:
    path = cache_dir() / "cpu_peak_tflops.json"
    table = {}
    if path.is_file():
        try:
            table = json.loads(path.read_text())
        except ValueError:
            table = {}
    measured = measure_cpu_peak_tflops()
    if measured > table.get(key, 0.0):
        table[key] = measured
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # ranks of one job may write at once
        tmp.write_text(json.dumps(table, indent=1))
        tmp.replace(path)
    return float(table[key])


def device_peak_tflops(device: torch.device, configured_cpu_peak: float = 0.0) -> float | None:
    if device.type == "cuda":
        return gpu_peak_tflops(torch.cuda.get_device_name(device))
    return configured_cpu_peak or cpu_peak_tflops()


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory on CUDA; peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**30
    kib = 1 / 1024 if sys.platform == "darwin" else 1  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * kib / 2**20
