"""Token and tokenizer caches on a multi-node job: two torchrun launchers on loopback act as two nodes, each with
its own home (so its own ~/.cache): each node builds what it reads, the job trains as one process does, and a
cache that one node cannot write stops both nodes with the same line instead of leaving one in a barrier."""

import os
import subprocess
import sys

import pytest

from tests.launch import free_port
from tests.titan.conftest import TINY, read_metrics, run_train

ARGS = [*TINY, "--training.steps", "2", "--training.global_batch_size", "4", "--comm.init_timeout_seconds", "60"]


def two_nodes(homes, dump_folder, timeout=240):
    """Both launchers' (returncode, output); node n runs with HOME=homes[n] and no cache variables."""
    endpoint = f"127.0.0.1:{free_port()}"
    base = {k: v for k, v in os.environ.items() if k not in ("TITAN_CACHE_DIR", "XDG_CACHE_HOME")}
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
             f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=caches",
             "-m", "titan.train", *ARGS, "--job.dump_folder", str(dump_folder)],
            env={**base, "HOME": str(home), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        for node, home in enumerate(homes)
    ]
    return [(p.communicate(timeout=timeout)[0], p.returncode)[::-1] for p in launchers]


def test_each_node_builds_the_caches_it_reads_and_the_job_matches_one_process(tmp_path):
    homes = [tmp_path / "node0", tmp_path / "node1"]
    for home in homes:
        home.mkdir()
    results = two_nodes(homes, tmp_path / "two_nodes")
    assert [code for code, _ in results] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    for home in homes:
        cached = sorted(p.name.split("-")[0] for p in (home / ".cache" / "titan").iterdir()
                        if p.suffix in (".npy", ".json"))
        assert cached == ["bpe", "tokens"], home
    run_train([*ARGS, "--job.dump_folder", str(tmp_path / "ref")])
    got, want = read_metrics(tmp_path / "two_nodes"), read_metrics(tmp_path / "ref")
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-5)


@pytest.mark.slow  # tests/titan/tools/test_agreement.py checks the same agreement with two ranks in seconds
def test_a_cache_one_node_cannot_write_stops_both_nodes_with_one_line(tmp_path):
    (tmp_path / "node0").mkdir()
    (tmp_path / "node1").write_text("a file where node 1's home folder would be")
    results = two_nodes([tmp_path / "node0", tmp_path / "node1"], tmp_path / "run", timeout=120)
    for code, output in results:
        errors = [line for line in output.splitlines() if line.startswith("error:")]
        assert code != 0 and len(errors) == 1, output[-3000:]
        assert errors[0].startswith("error: cannot write the cache file bpe-") and "TITAN_CACHE_DIR" in errors[0]
