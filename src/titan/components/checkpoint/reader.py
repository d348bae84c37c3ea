"""The one way a checkpoint is read, by training, export and inference alike.

Before any tensor is loaded: the manifest names the model, every data file has its recorded size and checksum,
and the metadata (read without unpickling code) fits the files. After loading: every value is finite. A damaged
checkpoint raises DamagedCheckpoint (the manager falls back to an earlier one); one of another model raises
CheckpointError naming what differs; one that would run code raises UnsafeCheckpoint (see safe_reader).
Every outcome is agreed by all ranks, so a problem only one rank sees stops every rank with the same line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from titan.components.checkpoint.integrity import describe, files_problem, nonfinite_entry
from titan.components.checkpoint.safe_reader import (
    CheckpointError,
    DamagedCheckpoint,
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpoint,
    metadata_problem,
)
from titan.tools.agreement import agree, agreed

MANIFEST = "titan.json"
IDENTITY = ("model", "flavor", "model_args")


__all__ = ["CheckpointError", "DamagedCheckpoint", "UnsafeCheckpoint", "read_checkpoint"]


def read_manifest(path: Path) -> dict[str, Any]:
    error = None
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if not isinstance(manifest, dict):
            error = f"its {MANIFEST} is not a JSON object"
    except (OSError, ValueError) as e:
        error, manifest = f"its {MANIFEST} is unreadable ({type(e).__name__})", {}
    error = agree(error)
    if error:
        raise DamagedCheckpoint(f"checkpoint {path}: {error}")
    return manifest


def _fields(model_args: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=([^,()]+)", model_args or ""))


def check_identity(path: Path, manifest: dict[str, Any], identity: dict[str, Any]) -> None:
    """Raises CheckpointError when the checkpoint holds another model, or the same one with other dimensions."""
    saved = f"{manifest.get('model')}/{manifest.get('flavor')}"
    here = f"{identity.get('model')}/{identity.get('flavor')}"
    if saved != here:
        raise CheckpointError(f"checkpoint {path} holds {saved}, this run builds {here}; use another "
                              "checkpoint.folder or job.dump_folder, or the model.name/flavor it was trained with")
    if "model_args" in identity and manifest.get("model_args") != identity["model_args"]:
        old, new = _fields(manifest.get("model_args", "")), _fields(identity["model_args"])
        diff = [f"{k} {old.get(k)} (this run {new.get(k)})" for k in sorted(old.keys() | new.keys())
                if old.get(k) != new.get(k)]
        raise CheckpointError(f"checkpoint {path} holds {saved} with other dimensions: {', '.join(diff[:4])}; "
                              "use the settings it was trained with (e.g. training.seq_len, model.dim) or another "
                              "checkpoint.folder")


def verify(path: Path, manifest: dict[str, Any]) -> None:
    """Raises DamagedCheckpoint when a recorded file is missing, resized or changed, or the metadata is bad."""
    problem = files_problem(path, manifest.get("files", {})) or agree(agreed(lambda: metadata_problem(path)))
    if problem:
        raise DamagedCheckpoint(f"checkpoint {path}: {problem}")


def read_checkpoint(path: Path, state: dict[str, Any], identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Loads `state` in place from the checkpoint folder `path` after every check; returns its manifest."""
    manifest = read_manifest(path)
    if identity is not None:
        check_identity(path, manifest, identity)
    verify(path, manifest)
    load_verified(path, state)
    return manifest


def load_verified(path: Path, state: dict[str, Any]) -> None:
    """DCP's load through the safe metadata reader, then every value checked finite; a failure on any rank
    raises DamagedCheckpoint on all of them. The folder's files are checked before (verify, metadata_problem)."""
    error: str | UnsafeCheckpoint | None = None
    planner = SafeLoadPlanner()
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=planner)
    except UnsafeCheckpoint as e:
        error = e
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException: name it
        error = UnsafeCheckpoint(path, planner.refused) if planner.refused else f"cannot load it: {describe(e)}"
    error = agree(error)
    if isinstance(error, UnsafeCheckpoint):
        raise error
    if error is None and (bad := nonfinite_entry(state)):
        error = f"{bad} holds NaN or Inf values"
    if error:
        raise DamagedCheckpoint(f"checkpoint {path}: {error}")
