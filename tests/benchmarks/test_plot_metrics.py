"""benchmarks/plot_metrics.py: a run's metrics.jsonl becomes its loss curve."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import assert_is_plot

ROOT = Path(__file__).resolve().parents[2]


def test_a_metrics_file_becomes_a_loss_curve(tmp_path):
    records = [{"step": s, "loss": 9.0 - s / 50, "elapsed_s": s * 0.4} for s in range(1, 301, 10)]
    records[-1]["val_loss"] = 3.1
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    subprocess.run([sys.executable, str(ROOT / "benchmarks/plot_metrics.py"), str(metrics), str(tmp_path / "a.png")],
                   check=True, capture_output=True, timeout=120)
    assert_is_plot(tmp_path / "a.png")
