"""Debugging a run in one process: profiler traces, the CPU memory report, autograd anomaly detection."""

import dataclasses
import json
import pickle

import pytest
import torch
from torch.profiler import ProfilerAction

from tests.titan.conftest import TINY
from titan.builders import BuildInputs
from titan.components.nonfinite import NonFiniteLossError
from titan.config import parse_args
from titan.config.job_config import Profiling
from titan.models import get_model_spec
from titan.tools.profiling import StepProfiler, trace_schedule
from titan.trainer import Trainer


def train(folder, steps, *args, model_spec=None):
    cfg = parse_args([*TINY, "--training.steps", str(steps), "--metrics.enable_jsonl", "false",
                      "--job.dump_folder", str(folder), *args])
    trainer = Trainer(cfg, BuildInputs(model_spec=model_spec))
    try:
        trainer.train()
    finally:
        trainer.close()


@pytest.mark.parametrize("freq, start, recorded", [(10, 0, [10, 20]), (2, 0, [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]),
                                                   (1, 0, list(range(1, 21))), (10, 7, [10, 20]), (4, 13, [16, 20])])
def test_schedule_records_the_steps_that_are_multiples_of_freq(freq, start, recorded):
    schedule = trace_schedule(freq, start)
    # Profiler step k runs training step start + k + 1.
    saved = [start + k + 1 for k in range(20 - start) if schedule(k) == ProfilerAction.RECORD_AND_SAVE]
    assert saved == recorded


def test_schedule_warms_up_before_recording():
    schedule = trace_schedule(10, 0)
    assert [schedule(k) for k in range(6, 10)] == [ProfilerAction.WARMUP] * 3 + [ProfilerAction.RECORD_AND_SAVE]


@pytest.fixture(scope="module")
def profiled(module_tmp_path):
    """Five steps with traces and memory reports every second step."""
    folder = module_tmp_path
    train(folder, 5, "--profiling.enable_profiling", "--profiling.profile_freq", "2",
          "--profiling.enable_memory_snapshot")
    return folder


def test_chrome_traces_are_written_at_every_profile_freq_step(profiled):
    traces = profiled / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_2", "iteration_4"]
    for iteration in traces.iterdir():
        trace = json.loads((iteration / "rank0_trace.json").read_text())
        events = trace["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
        assert len(steps) == 1, "one training step per trace"
        ops = [e for e in events if e.get("ph") == "X" and e.get("name") == "aten::mm"]
        assert ops and all(e["dur"] >= 0 and "ts" in e for e in ops)


def test_cpu_memory_report_has_every_step_and_the_ops_that_allocate(profiled):
    lines = (profiled / "memory_snapshot" / "rank0_memory.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert 50 < r["rss_mib"] <= r["peak_rss_mib"] < 100_000
    assert [r["peak_rss_mib"] for r in records] == sorted(r["peak_rss_mib"] for r in records)
    for step in (2, 4):
        table = (profiled / "memory_snapshot" / f"iteration_{step}" / "rank0_memory_ops.txt").read_text()
        assert "CPU Mem" in table and "aten::mm" in table


def test_cuda_snapshots_at_every_profile_freq_step_and_on_oom(tmp_path, monkeypatch):
    """The control flow only (no GPU here): the allocator's history calls are faked."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": []})
    config = Profiling(enable_memory_snapshot=True, profile_freq=2)
    with pytest.raises(torch.OutOfMemoryError):
        with StepProfiler(config, str(tmp_path), 3, torch.device("cuda", 0), start_step=0) as profiler:
            for step in range(1, 5):
                profiler.step(step)
            raise torch.OutOfMemoryError("CUDA out of memory")
    folders = sorted(p.name for p in (tmp_path / "memory_snapshot").iterdir())
    assert folders == ["iteration_2", "iteration_4", "iteration_5_oom"]
    for folder in folders:
        snapshot = tmp_path / "memory_snapshot" / folder / "rank3_memory_snapshot.pickle"
        assert pickle.loads(snapshot.read_bytes()) == {"segments": []}
    assert calls[0] == {"max_entries": 100_000} and calls[-1] == {"enabled": None}  # TorchTitan's history length


def nan_in_backward_loss(pred, labels):
    """Cross-entropy plus sqrt(0) * 0: zero in forward, 0 * inf = NaN in the backward of sqrt."""
    zero = (pred.sum() * 0).abs()
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten()) + zero.sqrt() * 0


@pytest.fixture
def nan_spec():
    return dataclasses.replace(get_model_spec("llama3", ""), loss_fn=nan_in_backward_loss)


def test_anomaly_detection_names_the_backward_op_that_made_a_nan_and_where(tmp_path, nan_spec):
    with pytest.warns(UserWarning, match=r"Error detected in SqrtBackward0(?s:.*)in nan_in_backward_loss"):
        with pytest.raises(RuntimeError, match="Function 'SqrtBackward0' returned nan values"):
            train(tmp_path, 1, "--debug.detect_anomaly", model_spec=nan_spec)
    assert not torch.is_anomaly_enabled()


def test_without_anomaly_detection_the_same_nan_only_shows_in_the_grad_norm(tmp_path, nan_spec):
    with pytest.raises(NonFiniteLossError, match="grad norm nan at step 1"):
        train(tmp_path, 1, model_spec=nan_spec)
