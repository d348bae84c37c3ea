"""Process-group set-up for debugging: flight recorder and debug-level environment, timeouts after step 1."""

import logging
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.titan.conftest import TINY
from titan.config import parse_args
from titan.distributed.runtime import apply_env, process_group_env, set_pg_timeouts, warn_if_cores_are_busy
from titan.trainer import Trainer

ENV_KEYS = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
            "TORCH_DISTRIBUTED_DEBUG")


def pg_timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def test_nccl_gets_the_flight_recorder_dumping_into_the_dump_folder(tmp_path):
    env = process_group_env("nccl", 2000, "off", str(tmp_path))
    assert env == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "comm_traces" / "rank_"),
    }


@pytest.mark.parametrize("backend, size", [("nccl", 0), ("gloo", 2000)])
def test_no_flight_recorder_when_off_or_on_gloo(backend, size):
    assert process_group_env(backend, size, "off", ".") == {}


@pytest.mark.parametrize("level, value", [("info", "INFO"), ("detail", "DETAIL")])
def test_distributed_debug_passes_through(level, value):
    assert process_group_env("gloo", 0, level, ".") == {"TORCH_DISTRIBUTED_DEBUG": value}


@pytest.fixture
def clean_env(monkeypatch):
    for key in ENV_KEYS:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    yield
    for key in ENV_KEYS:  # apply_env writes os.environ directly: undo it before monkeypatch restores
        os.environ.pop(key, None)
    dist.set_debug_level_from_env()


def test_apply_env_keeps_the_users_variables(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    wanted = process_group_env("nccl", 2000, "detail", str(tmp_path))
    set_now = apply_env(wanted)
    assert os.environ["TORCH_DISTRIBUTED_DEBUG"] == "INFO"
    assert "TORCH_DISTRIBUTED_DEBUG" not in set_now
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert (tmp_path / "comm_traces").is_dir()


def test_apply_env_updates_the_debug_level_c10d_read_at_import(clean_env):
    apply_env({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL


class MeshStub:
    """Mesh dims and a flattened view with groups of their own (a one-rank DeviceMesh reuses the default group)."""

    def __init__(self):
        self.dim_group, self.flat_group = dist.new_group([0]), dist.new_group([0])
        self._flatten_mapping = {"dp_shard_cp": None}

    def get_all_groups(self):
        return [self.dim_group]

    def get_group(self, name):
        return {"dp_shard_cp": self.flat_group}[name]


def test_set_pg_timeouts_reaches_the_default_mesh_and_flattened_groups(world_of_one):
    mesh = MeshStub()
    groups = set_pg_timeouts(42, mesh)
    assert len(groups) == 3
    for group in (dist.group.WORLD, mesh.dim_group, mesh.flat_group):
        assert pg_timeout(group) == timedelta(seconds=42)


def test_trainer_tightens_the_timeout_after_the_first_step(world_of_one, tmp_path, monkeypatch):
    cfg = parse_args([*TINY, "--training.steps", "3", "--comm.train_timeout_seconds", "42",
                      "--metrics.enable_jsonl", "false", "--job.dump_folder", str(tmp_path / "run")])
    trainer = Trainer(cfg)
    seen = []
    train_step = trainer.train_step

    def recording_train_step(data_iter):
        seen.append(pg_timeout(dist.group.WORLD))
        return train_step(data_iter)

    monkeypatch.setattr(trainer, "train_step", recording_train_step)
    trainer.train()
    trainer.close()
    assert seen == [timedelta(seconds=300), timedelta(seconds=42), timedelta(seconds=42)]


@pytest.mark.parametrize("load, threads, device, warned", [
    (5.0, 2, "cpu", True),  # other jobs fill both cores: two threads wait for each other at every op
    (1.5, 2, "cpu", False),  # a free core
    (5.0, 1, "cpu", False),  # one thread waits for no other
    (5.0, 2, "meta", False),  # the threads only feed an accelerator
])
def test_a_busy_machine_is_flagged_once_with_the_one_thread_fix(monkeypatch, caplog, load, threads, device, warned):
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with caplog.at_level(logging.WARNING, logger="titan"):
        warn_if_cores_are_busy(threads, torch.device(device))
    assert [r.getMessage().endswith("--debug.threads 1 can be several times faster") for r in caplog.records] == (
        [True] if warned else [])
