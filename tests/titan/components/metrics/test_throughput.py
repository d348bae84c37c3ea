"""MFU inputs: the GPU peak table, the measured and cached CPU peak, peak memory."""

import json

import pytest
import torch

from titan.components.metrics import throughput


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                        ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                        ("Some Future GPU", None)])
def test_gpu_peak_table(name, peak):
    assert throughput.gpu_peak_tflops(name) == peak


def test_cpu_peak_is_measured_once_per_process_and_the_cache_keeps_the_best(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    measurements = [0.5, 0.2, 0.7]  # three processes; the second ran on a loaded machine
    monkeypatch.setattr(throughput, "measure_cpu_peak_tflops", lambda: measurements.pop(0))
    seen = []
    for _ in range(3):
        throughput._best_cpu_peak_tflops.cache_clear()  # a new process
        seen.append(throughput.cpu_peak_tflops())
        assert throughput.cpu_peak_tflops() == seen[-1]  # once per process
    throughput._best_cpu_peak_tflops.cache_clear()
    assert seen == [0.5, 0.5, 0.7] and not measurements
    assert list(json.loads((tmp_path / "cpu_peak_tflops.json").read_text()).values()) == [0.7]


def test_measured_cpu_peak_is_a_plausible_matmul_rate():
    tflops = throughput.measure_cpu_peak_tflops(n=256, repeats=2)
    assert 1e-4 < tflops < 100


def test_configured_cpu_peak_wins():
    assert throughput.device_peak_tflops(torch.device("cpu"), 2.5) == 2.5


def test_peak_memory_is_the_process_rss():
    before = throughput.peak_memory_gib(torch.device("cpu"))
    blob = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert throughput.peak_memory_gib(torch.device("cpu")) >= before
    assert throughput.peak_memory_gib(torch.device("cpu")) > blob.numel() * 4 / 2**30
