"""Checkpoints are trusted only after checks: checksums per file, finite values, room to write, clean failures."""

import errno
import json
import logging
import os
import random
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.titan.components.checkpoint.test_manager import trained_linear
from titan.components.checkpoint import CheckpointError, CheckpointManager, DamagedCheckpoint, complete_steps
from titan.components.checkpoint.integrity import WRITE_HASH, file_digest, nonfinite_entry
from titan.config import JobConfig


def manager(folder, **overrides) -> CheckpointManager:
    config = JobConfig().checkpoint
    config.enable = True
    for k, v in overrides.items():
        setattr(config, k, v)
    return CheckpointManager(folder, config, {"model": "linear", "flavor": "tiny", "model_args": "Args(dim=4)"})


def saved_steps(folder, steps=(1, 2)):
    """A linear model checkpointed at `steps`, its weight set to the step number each time."""
    model, opt, sched = trained_linear()
    ckpt = manager(folder)
    for step in steps:
        with torch.no_grad():
            model.weight.fill_(float(step))
        ckpt.save(step, [model], [opt], [sched], {"step": step})
    return model, opt, sched


def resume(folder, caplog):
    model, opt, sched = trained_linear()
    with caplog.at_level(logging.WARNING, logger="titan"):
        state = manager(folder).load_latest([model], [opt], [sched], {"step": 0})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    return state, model, warnings


def flip_one_byte(path, rng):
    data = bytearray(path.read_bytes())
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def test_manifest_records_size_and_checksum_of_every_data_file(tmp_path):
    saved_steps(tmp_path, steps=(1,))
    step = tmp_path / "step-1"
    files = json.loads((step / "titan.json").read_text())["files"]
    assert sorted(files) == sorted(p.name for p in step.glob("*.distcp")) and files
    for name, entry in files.items():
        assert entry["bytes"] == (step / name).stat().st_size
        assert entry[WRITE_HASH] == file_digest(step / name)


@pytest.mark.parametrize("trial", range(20))
def test_same_size_bit_rot_falls_back_to_the_previous_checkpoint_with_one_warning(tmp_path, caplog, trial):
    saved_steps(tmp_path)
    rng = random.Random(trial)
    shard = rng.choice(sorted((tmp_path / "step-2").glob("*.distcp")))
    size = shard.stat().st_size
    flip_one_byte(shard, rng)
    assert shard.stat().st_size == size  # a size check alone would have loaded it
    state, model, warnings = resume(tmp_path, caplog)
    assert state["step"] == 1 and torch.all(model.weight == 1.0)
    assert len(warnings) == 1 and "step-2" in warnings[0] and "checksum" in warnings[0]


def test_explicit_load_step_of_a_damaged_checkpoint_is_an_error(tmp_path):
    saved_steps(tmp_path)
    flip_one_byte(next((tmp_path / "step-2").glob("*.distcp")), random.Random(0))
    model, opt, sched = trained_linear()
    with pytest.raises(DamagedCheckpoint, match="fails its .* checksum"):
        manager(tmp_path, load_step=2).load_latest([model], [opt], [sched], {"step": 0})


def test_non_finite_weights_are_never_saved(tmp_path):
    saved_steps(tmp_path, steps=(1,))
    model, opt, sched = trained_linear()
    with torch.no_grad():
        model.bias[0] = float("nan")
    with pytest.raises(CheckpointError, match=r"model.bias holds NaN or Inf values at step 2.*complete ones: \[1\]"):
        manager(tmp_path).save(2, [model], [opt], [sched], {"step": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


@pytest.mark.parametrize("stage", ["data", "manifest"])
def test_an_io_error_during_a_save_is_one_error_and_leaves_earlier_checkpoints(tmp_path, caplog, monkeypatch, stage):
    model, opt, sched = saved_steps(tmp_path, steps=(1,))
    full = OSError(errno.ENOSPC, "No space left on device")
    if stage == "data":
        real_save = dcp.save

        def save_then_fail(state, checkpoint_id):
            real_save(state, checkpoint_id=checkpoint_id)  # half the disk's worth written, then it is full
            raise full
        monkeypatch.setattr(dcp, "save", save_then_fail)
    else:
        def fail(*args, **kwargs):
            raise full
        monkeypatch.setattr("titan.components.checkpoint.manager.json.dumps", fail)
    with pytest.raises(CheckpointError) as info:
        manager(tmp_path).save(2, [model], [opt], [sched], {"step": 2})
    message = str(info.value)
    assert "cannot write checkpoint step-2.tmp" in message and "No space left on device" in message
    assert "complete ones ([1]) are intact" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
    monkeypatch.undo()
    state, _, warnings = resume(tmp_path, caplog)
    assert state["step"] == 1 and warnings == []


def test_room_is_checked_before_training(tmp_path, monkeypatch):
    ckpt = manager(tmp_path / "ckpt")
    ckpt.check_room(1e6)
    monkeypatch.setattr("titan.components.checkpoint.integrity.shutil.disk_usage",
                        lambda p: type("U", (), {"free": 2**29})())
    with pytest.raises(CheckpointError, match=r"has 0.50 GiB free, a checkpoint of this run takes about 2.00 GiB"):
        ckpt.check_room(2 * 2**30)
    monkeypatch.setattr("titan.components.checkpoint.integrity.os.access", lambda p, mode: False)
    with pytest.raises(CheckpointError, match="cannot be written"):
        ckpt.check_room(1.0)
    assert not (tmp_path / "ckpt").exists()


def test_stale_tmp_folders_are_removed_at_start_up(tmp_path):
    saved_steps(tmp_path, steps=(1,))
    (tmp_path / "step-2.tmp").mkdir()
    (tmp_path / "step-2.tmp" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "notes.tmp").mkdir()  # not ours: left alone
    manager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp", "step-1"]


@pytest.mark.parametrize("trial", range(5))
def test_nonfinite_entry_names_the_first_key_a_per_tensor_check_would(trial):
    rng = random.Random(trial)
    state = {"model": {f"w{i}": torch.randn(rng.randrange(1, 50), dtype=rng.choice([torch.float32, torch.bfloat16]))
                       for i in range(12)},
             "train_state": {"step": torch.tensor(3)}, "empty": torch.empty(0)}
    names = [f"model.w{i}" for i in range(12)]
    for name in rng.sample(names, rng.randrange(0, 3)):
        t = state["model"][name.split(".")[1]]
        t[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
    expected = next((n for n in names if not torch.isfinite(state["model"][n.split(".")[1]]).all()), None)
    assert nonfinite_entry(state) == expected


def test_a_rank_whose_shard_is_empty_checks_the_rest():
    """FSDP over 2 ranks of a 1-row weight leaves rank 1 nothing of it (a router of 2 experts over 4 ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        row = distribute_tensor(torch.ones(1, 4), init_device_mesh("cpu", (2,)), [Shard(0)])
        assert row.to_local().numel() == 0
        assert nonfinite_entry({"row": row, "w": torch.tensor([1.0, float("nan")])}) == "w"
    finally:
        dist.destroy_process_group()


def test_a_commit_fsyncs_the_manifest_and_the_folder_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("rename", str(a), str(b))) or real_replace(a, b))
    saved_steps(tmp_path, steps=(1,))
    tmp, final = str(tmp_path / "step-1.tmp"), str(tmp_path / "step-1")
    rename = events.index(("rename", tmp, final))
    synced_before = {e[1] for e in events[:rename] if e[0] == "fsync"}
    assert {f"{tmp}/titan.json", f"{tmp}/.metadata.tmp", tmp} <= synced_before  # DCP renames .metadata.tmp
    assert {f"{tmp}/{p.name}" for p in (tmp_path / "step-1").glob("*.distcp")} <= synced_before
    assert ("fsync", str(tmp_path)) in events[rename:]


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_rewriting_a_step_never_leaves_a_moment_without_it(tmp_path, monkeypatch, exchange):
    from titan.components.checkpoint import manager as manager_module

    saved_steps(tmp_path, steps=(1, 2))
    seen = []
    real_rmtree, real_replace = shutil.rmtree, os.replace

    def watch(real):
        def call(*args, **kwargs):
            seen.append(2 in complete_steps(tmp_path) or (tmp_path / "step-2.old" / "titan.json").is_file())
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(manager_module.shutil, "rmtree", watch(real_rmtree))
    monkeypatch.setattr(manager_module.os, "replace", watch(real_replace))
    if not exchange:
        monkeypatch.setattr(manager_module, "swap_folders", lambda a, b: False)
    model, opt, sched = trained_linear()
    with torch.no_grad():
        model.weight.fill_(7.0)
    manager(tmp_path).save(2, [model], [opt], [sched], {"step": 2})
    assert seen and all(seen)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-2"]
    monkeypatch.undo()
    model, opt, sched = trained_linear()
    assert manager(tmp_path).load_latest([model], [opt], [sched], {"step": 0})["step"] == 2
    assert torch.all(model.weight == 7.0)


def test_a_replaced_step_left_as_old_by_a_crash_is_put_back(tmp_path):
    saved_steps(tmp_path, steps=(1, 2))
    os.replace(tmp_path / "step-2", tmp_path / "step-2.old")  # the crash came between the two renames
    manager(tmp_path)
    assert complete_steps(tmp_path) == [1, 2] and not (tmp_path / "step-2.old").exists()
