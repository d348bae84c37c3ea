"""benchmarks/titan_quickstart.py: the quick start's command from each source tree, its wall time, time to the
first step, tokens/s and loss, read from what the run wrote."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model.n_layers", "1", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--metrics.cpu_peak_tflops", "1", "--metrics.log_freq", "1",
        "--validation.freq", "3", "--debug.threads", "1", "--metrics.enable_tensorboard", "false"]


def test_two_trees_side_by_side(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "benchmarks/titan_quickstart.py", "--tree", f"a={ROOT}", "--tree", f"b={ROOT}",
           "--together", "--out", str(out), "--", "--training.steps", "3", "--checkpoint.interval", "2", *TINY]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["results"]
    assert [r["name"] for r in rows] == ["a", "b"]
    for r in rows:
        records = [json.loads(line) for line in (out / r["name"] / "metrics.jsonl").read_text().splitlines()]
        assert r["returncode"] == 0 and r["steps"] == 3 and r["loss_last"] == records[-1]["loss"]
        assert r["val_loss"] == records[-1]["val_loss"]
        # Step 2 is the one steady step (step 1 warms up, step 3 validates).
        assert r["tps_median"] == records[1]["tps"] and r["mfu_median"] == records[1]["mfu"]
        assert 0 < r["first_step_s"] < r["wall_s"]
        # The default config's checkpoints.
        assert sorted(p.name for p in (out / r["name"] / "checkpoint").iterdir()) == ["step-2", "step-3"]
    assert "1st step s" in proc.stdout
