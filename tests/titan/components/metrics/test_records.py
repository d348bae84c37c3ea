"""A logged step's record: throughput over the window since the last logged step, MFU against the peak, ETA."""

import pytest
import torch

from titan.components.metrics import records
from titan.components.metrics.records import ThroughputWindow


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(records.time, "perf_counter", lambda: now[0])
    return now


def test_a_record_is_the_window_tokens_over_its_seconds(clock):
    window = ThroughputWindow(flops_per_token=3e6, peak_tflops=2.0, device=torch.device("cpu"))
    for _ in range(4):
        window.add_step(1000)
    clock[0] += 2.0
    record, eta = window.record(8, {"loss": 1.5, "grad_norm": 0.25, "tokens": 1000, "acc": 0.5}, 1e-3, 12.0, 6)
    assert record["tps"] == 2000.0
    assert record["tflops"] == pytest.approx(2000 * 3e6 / 1e12)
    assert record["mfu"] == pytest.approx(100 * 0.006 / 2.0)
    assert (record["step"], record["loss"], record["grad_norm"], record["lr"], record["elapsed_s"]) == (
        8, 1.5, 0.25, 1e-3, 12.0)
    assert record["acc"] == 0.5 and "tokens" not in record
    assert eta == pytest.approx(6 * 2.0 / 4)


def test_the_window_restarts_after_each_record(clock):
    window = ThroughputWindow(1.0, None, torch.device("cpu"))
    window.add_step(10)
    clock[0] += 1.0
    window.record(1, {"loss": 0.0, "grad_norm": 0.0}, 0.0, 1.0, 1)
    window.add_step(30)
    clock[0] += 3.0
    record, _ = window.record(2, {"loss": 0.0, "grad_norm": 0.0}, 0.0, 4.0, 0)
    assert record["tps"] == 10.0
    assert record["mfu"] is None, "no known peak: MFU is null, not a made-up number"
