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
    monkeypatch.setattr(throughput, "measure_matmul_peak_tflops", lambda dtype: {1024: measurements.pop(0)})
    seen = []
    for _ in range(3):
        throughput._best_cpu_peak_tflops.cache_clear()  # a new process
        seen.append(throughput.cpu_peak_tflops())
        assert throughput.cpu_peak_tflops() == seen[-1]  # once per process
    throughput._best_cpu_peak_tflops.cache_clear()
    assert seen == [0.5, 0.5, 0.7] and not measurements
    assert list(json.loads((tmp_path / "cpu_peak_tflops.json").read_text()).values()) == [0.7]


def test_peak_is_the_fastest_product_per_size_after_the_warm_up(monkeypatch):
    # A fake clock: each product of size n takes the next duration of its list; the first one (warm-up, 9 s) and
    # the slow ones (a loaded machine) must not count, the fastest must.
    durations = {64: [9.0, 0.4, 0.1, 0.3], 128: [9.0, 0.2, 0.8, 0.5]}
    pairs = {n: [t for d in durations[n] for t in (0.0, d)] for n in durations}
    ticks = iter([0.0, *pairs[64], 0.0, *pairs[128]])  # readings: start, size 64, the budget check, size 128
    monkeypatch.setattr(throughput, "perf_counter", lambda: next(ticks))
    rates = throughput.measure_matmul_peak_tflops("cpu", sizes=(64, 128), repeats=3, budget_s=60)
    assert rates == pytest.approx({64: 2 * 64**3 / 0.1 / 1e12, 128: 2 * 128**3 / 0.2 / 1e12})


def test_peak_measurement_stops_before_sizes_that_would_outlast_its_budget(monkeypatch):
    clock = iter(range(1000))  # every reading one second later: each product of the first size takes 1 s
    monkeypatch.setattr(throughput, "perf_counter", lambda: float(next(clock)))
    # 1 s for 64^3 predicts 512 s for 512^3 per product: over a 30 s budget, so only the first size is measured.
    assert list(throughput.measure_matmul_peak_tflops("cpu", sizes=(64, 512), repeats=2, budget_s=30)) == [64]


def test_the_cpu_peak_is_measured_and_cached_in_the_runs_compute_dtype(tmp_path, monkeypatch):
    # This box emulates bf16 at ~1/13 of its fp32 rate: an fp32 run divided by the bf16 peak showed 250% MFU.
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(throughput, "cpu_has_bf16_units", lambda: True)
    monkeypatch.setattr(throughput, "measure_matmul_peak_tflops",
                        lambda dtype: {256: {torch.bfloat16: 0.001, torch.float32: 0.013}[dtype]})
    throughput._best_cpu_peak_tflops.cache_clear()
    try:
        assert throughput.device_peak_tflops(torch.device("cpu"), torch.float32) == 0.013
        assert throughput.device_peak_tflops(torch.device("cpu"), torch.bfloat16) == 0.001
    finally:
        throughput._best_cpu_peak_tflops.cache_clear()
    keys = json.loads((tmp_path / "cpu_peak_tflops.json").read_text())
    assert sorted(k.rsplit("|", 1)[1] for k in keys) == ["bfloat16", "float32"]


def test_half_precision_on_a_cpu_that_emulates_it_has_no_mfu(monkeypatch):
    # The emulation gets faster with size past what the time budget measures: a measured figure is no peak.
    monkeypatch.setattr(throughput, "cpu_has_bf16_units", lambda: False)
    monkeypatch.setattr(throughput, "measure_matmul_peak_tflops", lambda dtype: pytest.fail("must not measure"))
    assert throughput.device_peak_tflops(torch.device("cpu"), torch.bfloat16) is None
    assert throughput.device_peak_tflops(torch.device("cpu"), torch.bfloat16, 2.5) == 2.5


def test_configured_cpu_peak_wins():
    assert throughput.device_peak_tflops(torch.device("cpu"), torch.float32, 2.5) == 2.5


def test_fp32_on_a_gpu_has_no_mfu_because_its_peak_depends_on_tf32(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    assert throughput.device_peak_tflops(torch.device("cuda"), torch.bfloat16) == 989.0
    assert throughput.device_peak_tflops(torch.device("cuda"), torch.float32) is None


def test_peak_memory_is_the_process_rss():
    before = throughput.peak_memory_gib(torch.device("cpu"))
    blob = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert throughput.peak_memory_gib(torch.device("cpu")) >= before
    assert throughput.peak_memory_gib(torch.device("cpu")) > blob.numel() * 4 / 2**30
