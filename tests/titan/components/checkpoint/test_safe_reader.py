"""DCP metadata is read without running code: a pickle that would run a command is refused before it runs, a real
checkpoint's metadata loads, and a shard shorter than the metadata says is named."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan.components.checkpoint.safe_reader import SafeFileSystemReader, load_metadata, metadata_problem


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
    with pytest.raises(ValueError, match=r"refers to posix\.system, which is not allowed"):
        load_metadata(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_a_dotted_name_through_an_allowed_module_is_refused(tmp_path):
    # Protocol 4's STACK_GLOBAL resolves "os.system" as an attribute path of DCP's filesystem module (it imports os).
    marker = tmp_path / "pwned"
    data = (pickle.PROTO + b"\x04" + _string("torch.distributed.checkpoint.filesystem") + _string("os.system")
            + pickle.STACK_GLOBAL + _string(f"touch {marker}") + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)
    (tmp_path / ".metadata").write_bytes(data)
    with pytest.raises(ValueError, match=r"filesystem\.os\.system, which is not allowed"):
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
    dcp.load(loaded, storage_reader=SafeFileSystemReader(str(path)))
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["h"], state["h"]) and loaded["step"] == 3


def test_a_shard_shorter_than_its_metadata_is_named(saved):
    path, _ = saved
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert metadata_problem(path) == f"shard {shard.name} is shorter than its metadata says"
