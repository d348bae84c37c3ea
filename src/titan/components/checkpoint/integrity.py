"""What makes a checkpoint trustworthy: a checksum per data file, finite values, room on the disk.

Every rank checks its share of the files (rank r the r-th, (r + world)-th, ... of the sorted names) and the
ranks agree on the outcome, so a multi-rank job reads each file once and every rank takes the same decision.
"""

from __future__ import annotations

import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan.tools.agreement import agree

try:  # xxh3 hashes about 3x faster than crc32 (benchmarks/RESULTS.md); xxhash comes with `datasets`
    import xxhash
except ImportError:  # e.g. a GPU host without `datasets`: checkpoints it writes carry crc32 instead
    xxhash = None

CHUNK = 16 << 20


class _Crc32:
    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


HASHES = {"crc32": _Crc32, **({"xxh3_64": xxhash.xxh3_64} if xxhash else {})}
WRITE_HASH = "xxh3_64" if xxhash else "crc32"


def file_digest(path: Path, algorithm: str = WRITE_HASH) -> str:
    hasher = HASHES[algorithm]()
    buffer = memoryview(bytearray(CHUNK))
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
    return hasher.hexdigest()


def data_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.distcp"))


def describe(e: BaseException) -> str:
    """One line for an I/O or DCP error; DCP's CheckpointException names only the failing ranks, so the first
    rank's own exception is described instead."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, inner = next(iter(sorted(failures.items(), key=lambda kv: kv[0])))
        if isinstance(inner, tuple):  # some DCP paths keep (exception, traceback frames)
            inner = inner[0]
        return f"rank {rank}: {describe(inner)}"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def _group() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _merge(part: dict[str, Any]) -> dict[str, Any]:
    rank, world = _group()
    if world == 1:
        return part
    parts: list[dict[str, Any]] = [{}] * world
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in sorted(p.items())}


def record_files(path: Path) -> dict[str, dict[str, Any]]:
    """Size and checksum of every data file of a written checkpoint, for its manifest (a collective)."""
    rank, world = _group()
    mine, error = {}, None
    try:
        for name in data_files(path)[rank::world]:
            mine[name] = {"bytes": (path / name).stat().st_size, WRITE_HASH: file_digest(path / name)}
    except OSError as e:  # still take part in the gather, so no rank waits for this one
        error = f"cannot read back {path.name}: {e}"
    if error := agree(error):
        raise OSError(error)
    return dict(sorted(_merge(mine).items()))


def _file_problem(path: Path, name: str, recorded: Any) -> str | None:
    file = path / name
    if not file.is_file():
        return f"shard {name} is missing"
    expected = recorded if isinstance(recorded, int) else recorded["bytes"]  # older manifests: sizes only
    size = file.stat().st_size
    if size != expected:
        return f"shard {name} has {size} bytes, {expected} were written"
    algorithm = next((a for a in HASHES if isinstance(recorded, dict) and a in recorded), None)
    if isinstance(recorded, dict) and algorithm is None:
        return f"shard {name} has a checksum this install cannot compute ({sorted(recorded)}); pip install xxhash"
    if algorithm and file_digest(file, algorithm) != recorded[algorithm]:
        return f"shard {name} fails its {algorithm} checksum (its bytes changed since it was written)"
    return None


def files_problem(path: Path, recorded: dict[str, Any]) -> str | None:
    """What is wrong with the recorded data files (missing, resized, changed), agreed by all ranks; or None."""
    rank, world = _group()
    error = None
    try:
        for name in sorted(recorded)[rank::world]:
            error = error or _file_problem(path, name, recorded[name])
    except OSError as e:
        error = f"cannot read it: {e}"
    return agree(error)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _floating(state: dict[str, Any], prefix: str):
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _floating(value, f"{name}.")
        elif isinstance(value, torch.Tensor) and value.is_floating_point() and _local(value).numel():
            # A rank's shard can be empty (FSDP over more ranks than a dim has rows), and has no max-norm.
            yield name, _local(value)


def _first_nonfinite(state: dict[str, Any]) -> str | None:
    """One max-norm per tensor (a NaN or Inf anywhere makes it non-finite), launched together, and one host read."""
    named = list(_floating(state, ""))
    if not named:
        return None
    names, tensors = zip(*named)
    device = tensors[0].device
    norms = torch._foreach_norm(list(tensors), float("inf"))
    finite = torch.stack([n.float().to(device) for n in norms]).isfinite().cpu()
    bad = (~finite).nonzero()
    return names[int(bad[0])] if len(bad) else None


def nonfinite_entry(state: dict[str, Any]) -> str | None:
    """The first key (on any rank) whose floating-point values are not all finite; None when all are."""
    return agree(_first_nonfinite(state))


def free_bytes(folder: Path) -> tuple[Path, int, bool]:
    """The folder's nearest existing ancestor, its free bytes and whether this process may write there."""
    probe = folder.absolute()
    while not probe.exists():
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free, probe.is_dir() and os.access(probe, os.W_OK)
