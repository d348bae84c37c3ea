"""Checkpoints survive crashes: damaged ones are skipped, nothing non-finite is saved, restarts resume."""

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.conftest import TINY, losses, read_metrics, run_train
from titan.checkpoint.safe_reader import SafeFileSystemReader, load_metadata

CKPT = [*TINY, "--checkpoint.enable", "--checkpoint.interval", "1"]


def run_with_fault(args, fault, nproc=1):
    os.environ["TITAN_FAULT"] = fault
    try:
        return run_train(args, nproc=nproc, check=False)
    finally:
        del os.environ["TITAN_FAULT"]


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """A run with committed checkpoints at steps 1, 2 and 3."""
    folder = tmp_path_factory.mktemp("three")
    run_train([*CKPT, "--training.steps", "3", "--job.dump_folder", str(folder)])
    return folder


def damaged_copy(three_steps, tmp_path, damage):
    folder = tmp_path / "run"
    shutil.copytree(three_steps / "checkpoint", folder / "checkpoint")
    damage(folder / "checkpoint" / "step-3")
    return folder


def truncate_shard(step_dir):
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])


def delete_shard(step_dir):
    next(step_dir.glob("*.distcp")).unlink()


def garble_metadata(step_dir):
    (step_dir / ".metadata").write_bytes(b"\x80\x04not a pickle")


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def malicious_metadata(step_dir):
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload()))


@pytest.mark.parametrize("damage, reason", [
    (truncate_shard, "bytes"), (delete_shard, "missing shard"), (garble_metadata, "bad checkpoint metadata"),
    (malicious_metadata, "posix.system, which is not allowed"),
], ids=["truncated", "missing", "garbled", "malicious"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous(three_steps, tmp_path, damage, reason):
    folder = damaged_copy(three_steps, tmp_path, damage)
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(folder)])
    assert "skipping unusable checkpoint" in proc.stdout and reason in proc.stdout
    assert "resumed from checkpoint" in proc.stdout and "step-2" in proc.stdout
    assert "pwned" not in proc.stdout
    assert [r["step"] for r in read_metrics(folder)] == [3, 4]
    assert losses(folder) == pytest.approx(losses(three_steps)[2:] + losses(folder)[1:], rel=1e-6)


def test_safe_reader_refuses_code_in_metadata(tmp_path):
    malicious_metadata(tmp_path)
    with pytest.raises(ValueError, match="not allowed"):
        load_metadata(tmp_path)


def test_kill_during_save_resumes_from_the_previous_checkpoint(tmp_path):
    proc = run_with_fault([*CKPT, "--training.steps", "4", "--job.dump_folder", str(tmp_path)], "0:3:save")
    assert proc.returncode != 0
    names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert names == ["step-1", "step-2", "step-3.tmp"]
    proc = run_train([*CKPT, "--training.steps", "4", "--job.dump_folder", str(tmp_path)])
    assert "step-2" in proc.stdout.split("resumed from checkpoint")[1].splitlines()[0]


def test_nan_loss_stops_with_the_step_and_saves_nothing_of_it(tmp_path):
    proc = run_with_fault([*CKPT, "--training.steps", "4", "--job.dump_folder", str(tmp_path)], "0:2:nan")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: non-finite loss nan") and "at step 2" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]


def test_nan_loss_can_skip_the_update(tmp_path):
    reference = tmp_path / "ref"
    run_train([*TINY, "--training.steps", "3", "--job.dump_folder", str(reference)])
    skipped = tmp_path / "skip"
    proc = run_with_fault([*TINY, "--training.steps", "3", "--training.on_nonfinite", "skip",
                           "--job.dump_folder", str(skipped)], "0:2:nan")
    assert proc.returncode == 0 and "step 2: non-finite loss" in proc.stdout
    got = read_metrics(skipped)
    assert got[0]["loss"] == losses(reference)[0]
    assert got[1]["loss"] != got[1]["loss"]  # NaN: logged, never applied


def test_async_save_gives_the_same_run_and_complete_checkpoints(tmp_path):
    sync, asyn = tmp_path / "sync", tmp_path / "async"
    run_train([*CKPT, "--training.steps", "3", "--job.dump_folder", str(sync)], nproc=2)
    run_train([*CKPT, "--training.steps", "3", "--checkpoint.async_mode", "async",
               "--job.dump_folder", str(asyn)], nproc=2)
    assert losses(asyn) == losses(sync)
    assert sorted(p.name for p in (asyn / "checkpoint").iterdir()) == ["step-1", "step-2", "step-3"]
    resumed = tmp_path / "resumed"
    shutil.copytree(asyn / "checkpoint" / "step-2", resumed / "checkpoint" / "step-2")
    run_train([*CKPT, "--training.steps", "3", "--training.global_batch_size", "4", "--job.dump_folder", str(resumed)])
    assert losses(resumed) == pytest.approx(losses(sync)[2:], rel=1e-5)


def test_seed_checkpoint_starts_every_layout_from_the_same_weights(tmp_path):
    seeded = [*TINY, "--training.steps", "2", "--training.global_batch_size", "4", "--checkpoint.enable",
              "--debug.full_init", "false"]
    one, two = tmp_path / "one", tmp_path / "two"
    run_train([*seeded, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(one)])
    shutil.copytree(one / "checkpoint", two / "checkpoint")
    run_train([*seeded, "--job.dump_folder", str(one)])
    run_train([*seeded, "--job.dump_folder", str(two)], nproc=2)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_seed_checkpoint_needs_one_process(tmp_path):
    proc = run_train([*TINY, "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                      "--job.dump_folder", str(tmp_path)], nproc=2, check=False)
    assert "error: checkpoint.create_seed_checkpoint runs on one process" in proc.stderr


def test_model_only_export_in_bf16(tmp_path):
    run_train([*CKPT, "--training.steps", "2", "--checkpoint.last_save_model_only", "--checkpoint.export_dtype",
               "bfloat16", "--job.dump_folder", str(tmp_path)])
    metadata = load_metadata(tmp_path / "checkpoint" / "step-2")
    keys = {k.split(".")[0] for k in metadata.state_dict_metadata}
    assert keys == {"model"}
    name = "model.output.weight"
    state = {name: torch.empty(metadata.state_dict_metadata[name].size, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=SafeFileSystemReader(str(tmp_path / "checkpoint" / "step-2")))
    assert torch.isfinite(state[name].float()).all()
    assert metadata.state_dict_metadata[name].properties.dtype == torch.bfloat16


def test_elastic_restart_after_a_killed_rank_finishes_the_run(tmp_path):
    args = [*CKPT, "--training.steps", "4"]
    reference = tmp_path / "ref"
    run_train([*args, "--job.dump_folder", str(reference)], nproc=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_FAULT": "1:3:step"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "-m", "titan.train", *args,
           "--job.dump_folder", str(tmp_path / "elastic")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fault injection: SIGKILL of rank 1 before step 3" in proc.stdout + proc.stderr
    records = read_metrics(tmp_path / "elastic")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["loss"] for r in records] == pytest.approx(losses(reference), rel=1e-5)
