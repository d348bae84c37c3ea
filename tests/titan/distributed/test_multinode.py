"""Two torchrun launchers on loopback act as two nodes: the same command trains as one job."""

import os
import subprocess
import sys

import pytest

from tests.launch import free_port
from tests.titan.conftest import TINY, read_metrics, run_train


def test_two_nodes_match_one_process(tmp_path):
    args = [*TINY, "--training.steps", "2", "--training.global_batch_size", "4"]
    run_train([*args, "--job.dump_folder", str(tmp_path / "ref")])
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=titan-test",
             "-m", "titan.train", *args, "--job.dump_folder", str(tmp_path / "two_nodes")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in range(2)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in launchers]
    assert [p.returncode for p in launchers] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    got, want = read_metrics(tmp_path / "two_nodes"), read_metrics(tmp_path / "ref")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)
