"""Reading DCP checkpoints so that no file of a checkpoint folder can run code, and checking files before loading.

A checkpoint folder may come from anywhere, and whoever wrote it also wrote its manifest's checksums, so nothing
in it is trusted. DCP keeps two pickles that its own reader would unpickle freely:
- the `.metadata`: read here by an unpickler that rebuilds DCP's metadata records, `torch.Size`, dtypes, layouts
  and paths, and refuses every other global (among them torch.storage's load-from-bytes helper, which would
  unpickle anything);
- bytes entries (values that are not tensors, e.g. an optimizer's learning rate): `SafeLoadPlanner` unpickles them
  with `torch.load(weights_only=True)`, and refuses a bytes entry where the state being loaded holds a tensor,
  since a checkpoint can declare any key as bytes.
Tensor data is read by DCP with `torch.load(weights_only=True)`. A refusal raises UnsafeCheckpoint, which no reader
takes for damage to fall back from: the folder is named and left alone.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from titan.tools.cli import UserError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_DCP_METADATA, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                          "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                          "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
"""Every global a genuine DCP `.metadata` names (checked on checkpoints of torch 2.x): classes whose rebuilding
runs none of the file's choosing, and no function that reaches `torch.load` or `pickle`."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used for this run (another model, missing step, unreadable)."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files are missing, changed or hold non-finite values."""


class UnsafeCheckpoint(CheckpointError):
    """A checkpoint holding a pickle that would run code or replace a tensor by an object: refused, never skipped."""

    def __init__(self, path: Path | str, what: str):
        self.path, self.what = path, what
        super().__init__(f"checkpoint {path}: {what}, which no checkpoint of titan or DCP holds: the folder may have "
                         "been written to run code, so nothing of it was loaded; delete it, or get the checkpoint "
                         "from a source you trust")

    def __reduce__(self):  # ranks agree on it through a pickle of their own
        return type(self), (self.path, self.what)


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # A dotted name (pickle protocol 4) reaches through a module's attributes: only plain names.
        if "." not in name and (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
            return getattr(torch, name)
        raise _Refused(f"its .metadata refers to {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused("its .metadata holds a persistent reference (a pickled tensor)")


def load_metadata(path: Path) -> Metadata:
    """The folder's DCP metadata; UnsafeCheckpoint for a pickle naming anything else, ValueError when garbled."""
    try:
        data = (path / ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise UnsafeCheckpoint(path, str(e)) from None
    except Exception as e:  # any other unpickling failure means the metadata is unusable
        raise ValueError(f"bad checkpoint metadata in {path}: {str(e)[:200]}") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"bad checkpoint metadata in {path}: not DCP metadata")
    for info in (metadata.storage_data or {}).values():
        name = str(getattr(info, "relative_path", ""))
        if not name or PurePath(name).name != name or name in (".", ".."):
            raise UnsafeCheckpoint(path, f"its .metadata points at the file {name[:100]!r} outside the folder")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except for bytes entries: unpickled with `torch.load(weights_only=True)`, and
    refused where the state being loaded holds a tensor (`refused` then names the key)."""

    def __init__(self):
        super().__init__()
        self.refused: str | None = None

    def create_local_plan(self):
        plan = super().create_local_plan()
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO and isinstance(self.state_dict.get(item.dest_index.fqn),
                                                                torch.Tensor):
                self.refused = f"its {item.dest_index.fqn} is a pickled object where the model holds a tensor"
                raise ValueError(self.refused)
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # a global weights_only refuses: an object no checkpoint of ours holds
            self.refused = f"its {read_item.dest_index.fqn} is a pickle naming {_first_line(e)}"
            raise
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def _first_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
    return (lines[0] if lines else str(e).splitlines()[0] if str(e) else type(e).__name__)[:160]


def metadata_problem(path: Path) -> str | None:
    """Why the metadata cannot be used (unreadable, not DCP's, or pointing past the end of a shard); or None.
    Raises UnsafeCheckpoint for metadata that would run code."""
    try:
        metadata = load_metadata(path)
    except UnsafeCheckpoint:
        raise
    except (ValueError, OSError) as e:
        return str(e)
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[str(info.relative_path)] = max(needed.get(str(info.relative_path), 0), info.offset + info.length)
    for name, end in needed.items():
        file = path / name
        if not file.is_file() or file.stat().st_size < end:
            return f"shard {name} is shorter than its metadata says"
    return None
