"""Reading DCP checkpoints without unpickling arbitrary objects, and checking files before loading.

DCP stores its `.metadata` as a pickle. A checkpoint folder may come from anywhere, so its metadata is read
with an unpickler that only rebuilds DCP's own metadata classes and a few plain types; anything else (a
payload that would run code) is refused. Tensor data is read by DCP with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("pathlib", "PosixPath"),
}


def _is_metadata_class(obj: Any) -> bool:
    """DCP's metadata records (dataclasses) and enums: building one runs no code of the file's choosing."""
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # A dotted name (pickle protocol 4) reaches through a module's attributes, e.g. DCP's filesystem module's
        # `os.system`: only plain names, and from DCP's modules only its metadata classes.
        if "." not in name and (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if "." not in name and module.startswith(_ALLOWED_MODULE_PREFIXES):
            found = super().find_class(module, name)
            if _is_metadata_class(found):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                           torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def load_metadata(path: Path) -> Metadata:
    try:
        data = (path / ".metadata").read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # any unpickling failure means the metadata is unusable
        raise ValueError(f"bad checkpoint metadata in {path}: {str(e)[:200]}") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"bad checkpoint metadata in {path}: not DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def metadata_problem(path: Path) -> str | None:
    """Why the metadata cannot be used (unreadable, not DCP's, or pointing past the end of a shard); or None."""
    try:
        metadata = load_metadata(path)
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
