"""Before a run starts: its estimated peak memory per rank against what the machine has (every layout, every
rank, in a forked child so the dry run's fake process group never meets the run's real one)."""

import pytest

from tests.titan.conftest import TINY, run_train
from titan.config import parse_args
from titan.estimate import fit
from titan.tools.cli import UserError


def test_the_child_returns_the_same_estimate_as_this_process():
    cfg = parse_args([*TINY, "--parallelism.data_parallel_shard_degree", "2"])
    assert fit.estimated_peak_bytes_in_child(cfg, 2) == fit.estimated_peak_bytes(cfg, 2)


def test_a_user_error_in_the_child_is_a_user_error_here():
    cfg = parse_args([*TINY, "--parallelism.tensor_parallel_degree", "3"])
    with pytest.raises(UserError, match="training.seq_len 32 must be divisible by .* tensor_parallel_degree = 3"):
        fit.estimated_peak_bytes_in_child(cfg, 3)


def test_a_bug_in_the_child_keeps_its_traceback(monkeypatch):
    def broken(job_config, world_size):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(fit, "estimated_peak_bytes", broken)
    with pytest.raises(RuntimeError, match=r"(?s)estimate failed:.*Traceback.*KeyError: 'a bug of ours'"):
        fit.estimated_peak_bytes_in_child(parse_args(TINY), 1)


def test_the_most_loaded_rank_is_compared_with_this_ranks_share_of_the_machine(monkeypatch):
    monkeypatch.setattr(fit, "available_bytes", lambda: (2**30, "available RAM / 2 local ranks"))
    cfg = parse_args([*TINY, "--training.seq_len", "8192"])
    need = sum(fit.estimated_peak_bytes(cfg, 2).values())
    assert need > 2**30
    with pytest.raises(UserError, match=rf"needs about {need / 2**30:.1f} GiB per rank .* of available RAM / 2"):
        fit.check_memory(cfg, 2)
    fit.check_memory(parse_args([*TINY, "--debug.memory_check", "false", "--training.seq_len", "8192"]), 2)


def test_a_multi_rank_run_that_cannot_fit_stops_before_training(tmp_path):
    # 866 GiB per rank at seq 1M: more than any machine this suite runs on, so the verdict is the same everywhere.
    proc = run_train(["--training.seq_len", "1000000", "--job.dump_folder", str(tmp_path / "out")],
                     nproc=2, check=False, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and all("this run needs about 866.0 GiB per rank" in line for line in errors), proc.stderr[-2000:]
    assert "device mesh" not in proc.stdout, "the dry run's own log lines stay in its child"
    assert not (tmp_path / "out").exists()
