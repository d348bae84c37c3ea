"""benchmarks/titan_mfu.py: MFU against the peak measured in the same run, side by side per variant, and the
profiled step's time per op class."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from titan_mfu import op_class  # noqa: E402


@pytest.mark.parametrize("name, scopes, cls", [
    ("aten::mm", [], "matmuls"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], "attention"),
    ("aten::copy_", ["Optimizer.step#AdamW.step"], "optimizer"),
    ("aten::copy_", ["aten::to"], "copies"),
    ("aten::nll_loss_forward", [], "loss"),
    ("## Call CompiledFxGraph abc ##", ["Torch-Compiled Region: 0/0"], "compiled"),
    ("aten::silu", [], "elementwise"),
])
def test_ops_fall_into_their_class(name, scopes, cls):
    assert op_class(name, scopes) == cls


# The debug Llama cut to 1 block at seq 64: 6 x non-embedding parameters (wq wo 256x256, wk wv 256x64, SwiGLU
# 3 x 256x704, three norms, the 4096-word output layer) + 12 x layers x heads x head_dim x seq.
FLOPS_PER_TOKEN = 6 * (2 * 256 * 256 + 2 * 256 * 64 + 3 * 256 * 704 + 3 * 256 + 256 * 4096) + 12 * 1 * 16 * 16 * 64


def test_variants_side_by_side_with_mfu_of_the_peak_measured_at_their_threads_and_dtype(tmp_path):
    # One thread each: a profiled step at 2 threads on a loaded box can take many times the timed ones.
    out = tmp_path / "out"
    fp32 = "--optimizer.implementation foreach --training.mixed_precision_param float32 --debug.threads 1"
    cmd = [sys.executable, "benchmarks/titan_mfu.py", "--config", "configs/titan/debug.toml", "--steps", "1",
           "--model.n_layers", "1", "--training.seq_len", "64", "--training.local_batch_size", "2",
           "--variant", "base", "--variant", f"fp32={fp32}", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "results.json").read_text())
    assert record["device"] == "cpu" and set(record["cpu"]) == {"capability", "amx", "avx512_bf16"}
    # One peak per thread count and compute dtype that a variant runs at, each the best of its measurements.
    peaks = {(p["threads"], p["dtype"]): p for p in record["peaks_tflops"]}
    assert set(peaks) == {(1, "bfloat16"), (1, "float32")}
    assert all(p["best"] == max(p["measured"]) > 0 for p in peaks.values())
    rows = {r["variant"]: r for r in record["results"]}
    assert list(rows) == ["base", "fp32"] and rows["fp32"]["overrides"] == fp32
    assert (rows["base"]["threads"], rows["base"]["dtype"]) == (1, "bfloat16")
    assert (rows["fp32"]["threads"], rows["fp32"]["dtype"]) == (1, "float32")
    for r in rows.values():
        assert r["tflops"] * 1e12 == pytest.approx(FLOPS_PER_TOKEN * r["tps"])
        assert r["mfu"] == pytest.approx(100 * r["tflops"] / peaks[r["threads"], r["dtype"]]["best"])
        assert r["tps"] == pytest.approx(r["tokens_per_step"] / r["step_s_median"]) and r["tokens_per_step"] == 128
        assert len(r["cpu_s"]) == 1 and 0 < r["cpu_s_median"] == r["cpu_s"][0] < 2 * r["step_s_median"]
        # The profiled step's self times add up to about one step (the profiler's own overhead on top): its CPU
        # seconds, since a loaded box stretches a timed step's wall time far more than its ops' busy time.
        assert {"matmuls", "attention", "optimizer"} <= set(r["breakdown_s"])
        assert 0.3 * r["cpu_s_median"] < sum(r["breakdown_s"].values()) < 5 * r["step_s_median"]
    assert "MFU %" in proc.stdout and "matmuls" in proc.stdout
