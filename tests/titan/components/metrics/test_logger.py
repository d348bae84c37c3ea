"""The metric sinks: metrics.jsonl appended line by line, tensorboard scalars as tensorboard reads them, the
console line, and nothing at all from ranks other than 0."""

import json
import logging

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from titan.components.metrics.logger import MetricsLogger

RECORD = {"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-3, "tps": 10.0, "tflops": 0.1, "mfu": None,
          "memory_gib": 1.0, "elapsed_s": 0.5, "acc": 0.25}


def test_jsonl_is_appended_so_a_resumed_run_continues_the_file(tmp_path):
    for _ in range(2):
        sink = MetricsLogger(str(tmp_path), enable_jsonl=True, enable_tensorboard=False, rank=0)
        sink.log(RECORD, eta_s=3.0)
        sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [RECORD, RECORD]


def test_tensorboard_holds_every_numeric_value_at_its_step(tmp_path):
    sink = MetricsLogger(str(tmp_path), enable_jsonl=False, enable_tensorboard=True, rank=0, tb_folder="events")
    sink.log(RECORD, eta_s=0.0)
    sink.log({**RECORD, "step": 2, "loss": 1.5}, eta_s=0.0)
    sink.close()
    events = EventAccumulator(str(tmp_path / "events"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(k for k, v in RECORD.items()
                                                      if k != "step" and isinstance(v, float))
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.0), (2, 1.5)]


def test_the_console_line_shows_step_loss_throughput_mfu_memory_and_eta(tmp_path, caplog):
    sink = MetricsLogger(str(tmp_path), enable_jsonl=False, enable_tensorboard=False, rank=0)
    with caplog.at_level(logging.INFO, logger="titan"):
        sink.log(RECORD, eta_s=125.0)
    line = caplog.records[-1].getMessage()
    assert line.split() == ["step", "1", "loss", "2.0000", "grad_norm", "1.000", "lr", "1.00e-03", "tps", "10",
                            "mfu", "n/a", "mem", "1.00GiB", "acc", "0.2500", "eta", "2:05"]


def test_only_rank_zero_writes(tmp_path):
    sink = MetricsLogger(str(tmp_path / "r1"), enable_jsonl=True, enable_tensorboard=True, rank=1)
    sink.log({"step": 1}, eta_s=0)
    sink.close()
    assert not (tmp_path / "r1").exists()
