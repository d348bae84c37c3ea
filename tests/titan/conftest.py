"""Helpers to run the real entry point, in one process or under torchrun, and read what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import run_module

# A small but real run: the debug Llama shortened to 2 layers, short sequences, fp32 for exact comparisons.
TINY = [
    "--model.n_layers", "2",
    "--training.seq_len", "32",
    "--training.local_batch_size", "2",
    "--training.mixed_precision_param", "float32",
    "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false",
    "--metrics.cpu_peak_tflops", "1.0",
    "--lr_scheduler.warmup_steps", "2",
    "--validation.enable", "false",  # on in configs/titan/debug.toml, the default config; tests turn it on by name
    "--checkpoint.enable", "false",  # likewise
]


def run_train(args, nproc=1, check=True, timeout=300, module="titan.train", fault="", max_restarts=0):
    """`fault`: TITAN_FAULT for the run; `max_restarts` > 0: an elastic torchrun job that restarts failed workers.

    Other runs are forked with torch already imported (tests/launch.py); tests/titan/tools/test_signals.py and the
    elastic ones run under torchrun itself."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TITAN_FAULT": fault}
    if max_restarts:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
               "-m", module, *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    else:
        proc = run_module(module, args, env, nproc=nproc, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(proc.args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def read_metrics(folder) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(folder) -> list[float]:
    return [r["loss"] for r in read_metrics(folder)]


def assert_same_run(records, reference, rtol=1e-5):
    """Same steps, losses and gradient norms within `rtol` (sharded reductions sum in another order)."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference):
        assert got["loss"] == pytest.approx(want["loss"], rel=rtol), got["step"]
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rtol), got["step"]


@pytest.fixture
def tiny_args():
    return list(TINY)
