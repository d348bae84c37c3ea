"""SIGTERM / SIGINT during training: the step finishes, a checkpoint of it is written, every rank exits cleanly."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.titan.conftest import TINY

RUN = [*TINY, "--training.steps", "100000", "--checkpoint.enable", "--checkpoint.interval", "100000"]


def start(folder, nproc=1):
    launcher = [sys.executable, "-m", "titan.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "titan.train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # A session of its own: the signal goes to the whole group, as a terminal's Ctrl-C or SLURM's scancel does.
    return subprocess.Popen([*launcher, *RUN, "--job.dump_folder", str(folder)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def stop_after_two_steps(proc, folder, signum):
    metrics = folder / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=240)
    return out, err


def saved_step(folder, err):
    match = re.search(r"interrupted by SIG\w+: stopped after step (\d+), checkpoint step-\1 saved", err)
    assert match, err[-3000:]
    step = int(match.group(1))
    names = sorted(p.name for p in (folder / "checkpoint").iterdir())
    assert names == [f"step-{step}"]  # committed, and no .tmp left behind
    assert json.loads((folder / "checkpoint" / names[0] / "titan.json").read_text())["step"] == step
    return step


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_step_and_exits_with_one_line(tmp_path, signum, code):
    proc = start(tmp_path)
    out, err = stop_after_two_steps(proc, tmp_path, signum)
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    step = saved_step(tmp_path, err)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step  # the saved step is the last one trained


def test_every_rank_stops_at_the_same_step_under_torchrun(tmp_path):
    proc = start(tmp_path, nproc=2)
    out, err = stop_after_two_steps(proc, tmp_path, signal.SIGTERM)
    saved_step(tmp_path, err)
    assert err.count("interrupted by SIGTERM") == 1  # one line, from rank 0
    # No worker prints a traceback (torchrun itself still reports its own SignalException).
    assert "KeyboardInterrupt" not in err and "/titan/" not in err


def test_the_stop_flags_ride_on_a_sum_and_any_ranks_signal_stops_all():
    from titan.tools.signals import StopSignals

    like = torch.zeros(3)
    with StopSignals() as mine, StopSignals() as peer:
        assert mine.flags(like).tolist() == [0.0, 0.0] and mine.agreed([0.0, 0.0]) == 0
        os.kill(os.getpid(), signal.SIGTERM)  # the inner handler, `peer`'s, is the one installed now
        summed = (mine.flags(like) + peer.flags(like)) / 2  # the loss's mean over two ranks
        assert peer.agreed(summed.tolist()) == signal.SIGTERM
        assert mine.agreed(summed.tolist()) == signal.SIGTERM, "the rank without the signal stops with it"
