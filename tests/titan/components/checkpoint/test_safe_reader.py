"""DCP checkpoints are read without running code: a metadata pickle naming anything but DCP's records is refused
before it runs, a bytes entry loads with weights_only=True and never where a tensor is expected, a real
checkpoint's metadata and values load, and a shard shorter than the metadata says is named."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.titan.components.checkpoint.poison import Payload as OpenMarker
from tests.titan.components.checkpoint.poison import poison_bytes_entry, poison_metadata
from titan.components.checkpoint.safe_reader import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpoint,
    load_metadata,
    metadata_problem,
)


class Payload:
    """Unpickling it runs a shell command that creates the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def malicious_metadata(step_dir):
    (step_dir / ".metadata").write_bytes(pickle.dumps(Payload(step_dir / "pwned")))


def _string(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def test_safe_reader_refuses_code_in_metadata(tmp_path):
    malicious_metadata(tmp_path)
    with pytest.raises(UnsafeCheckpoint, match=r"its \.metadata refers to posix\.system, which no checkpoint"):
        load_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_a_dotted_name_through_an_allowed_module_is_refused(tmp_path):
    # Protocol 4's STACK_GLOBAL resolves "os.system" as an attribute path of DCP's filesystem module (it imports os).
    marker = tmp_path / "pwned"
    data = (pickle.PROTO + b"\x04" + _string("torch.distributed.checkpoint.filesystem") + _string("os.system")
            + pickle.STACK_GLOBAL + _string(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(UnsafeCheckpoint, match=r"refers to torch\.distributed\.checkpoint\.filesystem\.os\.system"):
        load_metadata(tmp_path)
    assert not marker.exists()


@pytest.fixture
def saved(tmp_path):
    state = {"w": torch.arange(12.0).reshape(3, 4), "h": torch.ones(2, dtype=torch.bfloat16), "step": 3}
    dcp.save(state, checkpoint_id=str(tmp_path))
    return tmp_path, state


def test_a_real_checkpoint_reads_back_through_the_safe_reader(saved):
    path, state = saved
    assert metadata_problem(path) is None
    assert set(load_metadata(path).state_dict_metadata) == {"w", "h", "step"}
    loaded = {"w": torch.zeros(3, 4), "h": torch.zeros(2, dtype=torch.bfloat16), "step": 0}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["h"], state["h"]) and loaded["step"] == 3


def test_a_shard_shorter_than_its_metadata_is_named(saved):
    path, _ = saved
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert metadata_problem(path) == f"shard {shard.name} is shorter than its metadata says"


def test_metadata_reaching_torch_load_through_load_from_bytes_is_refused(saved):
    path, _ = saved
    poison_metadata(path, path / "pwned")
    with pytest.raises(UnsafeCheckpoint, match=r"refers to torch\.storage\._load_from_bytes"):
        load_metadata(path)
    assert not (path / "pwned").exists()


def test_a_pickled_tensor_in_metadata_is_refused(saved):
    path, _ = saved
    metadata = load_metadata(path)
    metadata.planner_data["extra"] = torch.ones(2)  # pickles through torch._utils._rebuild_tensor_v2
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match=r"torch\._utils\._rebuild_tensor_v2"):
        load_metadata(path)


def test_metadata_pointing_outside_the_folder_is_refused(saved):
    path, _ = saved
    metadata = load_metadata(path)
    info = next(iter(metadata.storage_data.values()))
    info.relative_path = "../../etc/passwd"
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpoint, match=r"points at the file '../../etc/passwd' outside the folder"):
        load_metadata(path)


def test_a_bytes_entry_where_a_tensor_is_expected_is_refused_unread(saved):
    path, _ = saved
    poison_bytes_entry(path, path / "pwned", key="w")
    planner = SafeLoadPlanner()
    with pytest.raises(CheckpointException):  # DCP wraps the planner's refusal in its own exception
        dcp.load({"w": torch.zeros(3, 4), "h": torch.zeros(2, dtype=torch.bfloat16), "step": 0},
                 storage_reader=SafeFileSystemReader(str(path)), planner=planner)
    assert planner.refused == "its w is a pickled object where the model holds a tensor"
    assert not (path / "pwned").exists()


def test_a_bytes_entry_that_unpickles_code_is_refused_where_an_object_is_expected(saved):
    path, _ = saved
    marker = path / "pwned"
    dcp.save({"w": torch.zeros(3, 4), "step": OpenMarker(marker)},
             storage_writer=dcp.FileSystemWriter(path, overwrite=True))
    planner = SafeLoadPlanner()
    with pytest.raises(CheckpointException):
        dcp.load({"w": torch.zeros(3, 4), "step": 0}, storage_reader=SafeFileSystemReader(str(path)), planner=planner)
    assert planner.refused.startswith("its step is a pickle naming") and not marker.exists()
