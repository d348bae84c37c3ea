"""Hostile checkpoints, as an attacker who owns the whole folder writes them: each runs a payload that creates a
marker file if any reader unpickles it, and its manifest's sizes and checksums are recomputed so they match.

- `poison_metadata`: a genuine `.metadata` with one extra value built by `torch.storage._load_from_bytes`
  (which is `torch.load(weights_only=False)`) from a pickle of the payload.
- `poison_bytes_entry`: a genuine `dcp.save` in which one model weight is a pickled object: DCP records it as a
  bytes entry, and its default load planner unpickles bytes entries with `torch.load(weights_only=False)`.
"""

import io
import json
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from titan.components.checkpoint.integrity import record_files


class Payload:
    """Unpickling it creates the file `marker` (opening it for writing is enough)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class ThroughLoadFromBytes:
    """Pickles as `torch.storage._load_from_bytes(<torch.save of the payload>)`."""

    def __init__(self, marker):
        buffer = io.BytesIO()
        torch.save(Payload(marker), buffer)
        self.data = buffer.getvalue()

    def __reduce__(self):
        return (torch.storage._load_from_bytes, (self.data,))


def _refresh_manifest(step_dir: Path) -> None:
    manifest_path = step_dir / "titan.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        manifest["files"] = record_files(step_dir)
        manifest_path.write_text(json.dumps(manifest, indent=1))


def poison_metadata(step_dir, marker) -> None:
    step_dir = Path(step_dir)
    with (step_dir / ".metadata").open("rb") as f:
        metadata = pickle.load(f)  # our own genuine file
    metadata.planner_data["extra"] = ThroughLoadFromBytes(marker)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    _refresh_manifest(step_dir)


def poison_bytes_entry(step_dir, marker, key: str | None = None) -> str:
    """Rewrites the checkpoint with the model weight `key` (default: the first) stored as a pickled payload;
    returns that key."""
    step_dir = Path(step_dir)
    buffer = step_dir / "full.pt"
    dcp_to_torch_save(step_dir, buffer)
    state = torch.load(buffer, weights_only=True)  # our own genuine checkpoint, all tensors
    buffer.unlink()
    weights = state["model"] if "model" in state else state
    key = key or next(iter(weights))
    weights[key] = Payload(marker)
    for shard in step_dir.glob("*.distcp"):
        shard.unlink()
    with warnings.catch_warnings():  # DCP warns that it overwrites: that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(step_dir, overwrite=True), no_dist=True)
    _refresh_manifest(step_dir)
    return key
