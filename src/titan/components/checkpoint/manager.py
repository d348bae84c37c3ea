"""CheckpointManager over torch.distributed.checkpoint (DCP), with durable, atomic commits.

A checkpoint is written to `step-N.tmp/` by every rank (DCP fsyncs each file); after a barrier rank 0 writes
`titan.json` (what was saved, by which model, each data file's size and checksum), fsyncs it and the folder, and
renames the folder to `step-N/`, then fsyncs the checkpoint folder. A folder without that name and file is never
loaded, so a crash or power loss mid-save leaves the previous checkpoint as the latest; rewriting an existing
`step-N` swaps the two folders in one rename, so there is never a moment without it. A save that fails (a full
disk, a read-only folder) removes its `.tmp` and stops the run in one line. Rank 0 lists the complete steps and
chooses the one to load for every rank; loading skips a damaged checkpoint for the previous one with one warning,
and a problem seen by any one rank is every rank's (integrity.agree).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from titan.components.checkpoint.integrity import describe, free_bytes, nonfinite_entry, record_files
from titan.components.checkpoint.reader import (
    MANIFEST,
    CheckpointError,
    DamagedCheckpoint,
    check_identity,
    read_checkpoint,
    read_manifest,
)
from titan.components.checkpoint.safe_reader import UnsafeCheckpoint, load_metadata
from titan.tools.agreement import agree, agreed
from titan.tools.fault import fault_point
from titan.tools.logging import logger

# Flattened optimizer keys ("state.layers.0.w.exp_avg") merge across pipeline stages and reshard.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
PARTIAL = StateDictOptions(strict=False)
# Saving or loading from one process is intended here, not a misconfiguration.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_DIR = re.compile(r"^step-\d+\.(tmp|old)$")
# DCP reports a rank's failed write as CheckpointException, which derives from BaseException.
WRITE_ERRORS = (OSError, CheckpointException)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def complete_steps(folder: Path) -> list[int]:
    """Steps with a committed checkpoint, oldest first, as this process sees the folder."""
    if not folder.is_dir():
        return []
    steps = []
    for entry in folder.iterdir():
        m = STEP_DIR.match(entry.name)
        if m and (entry / MANIFEST).is_file() and (entry / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def agreed_steps(folder: Path) -> list[int]:
    """Rank 0's complete steps, on every rank: a lagging shared filesystem cannot make ranks load different ones."""
    steps = [complete_steps(folder)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(steps, src=0)
    return steps[0]


def fsync_path(path: Path) -> None:
    """Flushes a file's data, or a folder's entries (names created or renamed in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2


def swap_folders(a: Path, b: Path) -> bool:
    """Exchanges two folders' names in one step (Linux renameat2); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def publish_folder(tmp: Path, final: Path) -> None:
    """Makes `tmp` the folder `final`, durably; an existing `final` stays complete until the new one replaces it."""
    fsync_path(tmp)
    if final.exists():
        if swap_folders(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # two renames; a crash between them leaves `step-N.old`, which the next run puts back
            old = final.with_name(f"{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(final.parent)


class ReusedStagingBuffer(BlockingAsyncStager):
    """Stages each async save into the same host copy of the state, rebuilt only when the state's layout changes.

    A fresh copy per save spends most of its time allocating and first-touching pages, which a reused buffer
    has done once (benchmarks/RESULTS.md); on CUDA the buffer is pinned, so device-to-host copies run at full speed. The
    manager waits for the previous save before staging the next, so the buffer is never read while rewritten.
    """

    def __init__(self):
        super().__init__(cache_staged_state_dict=True)
        self._layout = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        leaves = torch.utils._pytree.tree_leaves(state_dict)
        layout = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in leaves]
        if layout != self._layout:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        return _copy_state_dict(state_dict, self.state_dict_cache)


class CheckpointManager:
    def __init__(self, folder: str | Path, checkpoint_config, model_identity: dict[str, Any]):
        self.folder = Path(folder)
        self.config = checkpoint_config
        self.identity = model_identity
        self._pending: tuple | None = None
        self._async_group = None
        self._stager = ReusedStagingBuffer() if checkpoint_config.reuse_staging_buffer else None
        if checkpoint_config.enable and checkpoint_config.async_mode == "async" and dist.is_initialized():
            # Background writes must not share the training collectives' group (they would interleave).
            self._async_group = dist.new_group(backend="gloo")
        if checkpoint_config.enable and _rank() == 0:
            self._remove_stale_tmp()

    @property
    def enabled(self) -> bool:
        return self.config.enable

    def should_save(self, step: int, last_step: int) -> bool:
        return self.enabled and (step % self.config.interval == 0 or step == last_step)

    def _remove_stale_tmp(self) -> None:
        """Half-written `step-N.tmp` folders of a crashed run are never loaded; they only take disk space. A
        `step-N.old` is a complete checkpoint whose replacement was interrupted: it is put back if it is missing."""
        stale = [p for p in self.folder.glob("step-*.*") if TMP_DIR.match(p.name)] if self.folder.is_dir() else []
        for path in stale:
            final = path.with_suffix("")
            if path.suffix == ".old" and not final.exists():
                os.replace(path, final)
                continue
            shutil.rmtree(path, ignore_errors=True)
        if stale:
            logger.info(f"removed {len(stale)} unfinished checkpoint folder(s) of an interrupted save in {self.folder}")

    def check_room(self, checkpoint_bytes: float) -> None:
        """Before step 1: the folder can be written and has room for one more checkpoint of about this size."""
        where, free, writable = free_bytes(self.folder)
        if not writable:
            raise CheckpointError(f"checkpoint folder {self.folder} cannot be written ({where} is not a writable "
                                  "folder); point --checkpoint.folder or --job.dump_folder elsewhere, or "
                                  "--checkpoint.enable false")
        if free < checkpoint_bytes:
            raise CheckpointError(f"checkpoint folder {self.folder} has {free / 2**30:.2f} GiB free, a checkpoint "
                                  f"of this run takes about {checkpoint_bytes / 2**30:.2f} GiB; free space, point "
                                  "--checkpoint.folder or --job.dump_folder to a larger disk, or lower "
                                  "checkpoint.keep_latest_k")

    def _state(self, parts, optimizers, lr_schedulers, train_state: dict[str, int]) -> dict[str, Any]:
        """One flat, layout-independent state: keys are the full model's parameter names, whatever part of the
        model (pipeline stages) this rank holds. Scalars travel as tensors so nothing of ours is pickled."""
        model, optim = {}, {}
        for part, opt in zip(parts, optimizers):
            model.update(get_model_state_dict(part))
            optim.update(get_optimizer_state_dict(part, opt, options=FLAT))
        return {
            "model": model,
            "optimizer": optim,
            "lr_scheduler": {"last_epoch": torch.tensor(lr_schedulers[0].last_epoch)},
            "train_state": {k: torch.tensor(v, dtype=torch.int64) for k, v in train_state.items()},
        }

    def save(self, step: int, parts, optimizers, lr_schedulers, train_state: dict[str, int]) -> None:
        """Writes a full training checkpoint; in async mode returns once the state is staged."""
        self._write(step, self._state(parts, optimizers, lr_schedulers, train_state),
                    asynchronous=self.config.async_mode == "async")

    def save_model_only(self, step: int, parts, dtype: torch.dtype) -> None:
        """Weights only (e.g. a seed checkpoint, or an export for inference) in `dtype`."""
        model = {}
        for part in parts:
            model.update({k: v.to(dtype) for k, v in get_model_state_dict(part).items()})
        self._write(step, {"model": model}, asynchronous=False)

    def _write(self, step: int, state: dict[str, Any], asynchronous: bool) -> None:
        self.wait()
        if bad := nonfinite_entry(state):
            raise CheckpointError(f"{bad} holds NaN or Inf values at step {step}, so no checkpoint of it was "
                                  f"written (complete ones: {complete_steps(self.folder) or 'none'}); lower "
                                  "optimizer.lr or set training.max_norm, then rerun to resume")
        final = self.folder / f"step-{step}"
        tmp = self.folder / f"step-{step}.tmp"

        def start() -> None:
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        self._guarded(step, tmp, start)
        if asynchronous:
            future = self._guarded(step, tmp, lambda: dcp.async_save(
                state, checkpoint_id=str(tmp), process_group=self._async_group, async_stager=self._stager))
            self._pending = (future, step, tmp, final, sorted(state))
        else:
            self._guarded(step, tmp, lambda: dcp.save(state, checkpoint_id=str(tmp)))
            fault_point("save", step)
            self._commit(step, tmp, final, sorted(state))

    def _guarded(self, step: int, tmp: Path, action):
        """Runs one collective part of a save; an I/O error on any rank removes the `.tmp` and raises one line."""
        result, error = None, None
        try:
            result = action()
        except WRITE_ERRORS as e:
            error = describe(e)
        if error := agree(error):
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"cannot write checkpoint {tmp.name} in {self.folder}: {error}; the complete "
                                  f"ones ({complete_steps(self.folder) or 'none'}) are intact. Free space or fix "
                                  "the folder's permissions, then rerun the same command to resume")
        return result

    def wait(self) -> None:
        """Finishes an async save in flight: waits for every rank's writes, then commits."""
        if self._pending is None:
            return
        future, step, tmp, final, contents = self._pending
        self._pending = None
        self._guarded(step, tmp, future.result)
        fault_point("save", step)
        self._commit(step, tmp, final, contents)

    def _commit(self, step: int, tmp: Path, final: Path, contents: list[str]) -> None:
        files = self._guarded(step, tmp, lambda: record_files(tmp))

        def publish() -> None:
            if _rank() == 0:
                world = dist.get_world_size() if dist.is_initialized() else 1
                manifest = {**self.identity, "step": step, "world_size": world, "contents": contents, "files": files}
                with (tmp / MANIFEST).open("w") as f:
                    f.write(json.dumps(manifest, indent=1))
                    f.flush()
                    os.fsync(f.fileno())
                publish_folder(tmp, final)

        self._guarded(step, tmp, publish)
        if _rank() == 0:
            self._prune()
            logger.info(f"saved checkpoint {final}")
        _barrier()

    def _prune(self) -> None:
        k = self.config.keep_latest_k
        if k > 0:
            for step in complete_steps(self.folder)[:-k]:
                shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)

    def load_latest(self, parts, optimizers, lr_schedulers, train_state: dict[str, int]) -> dict[str, int] | None:
        """Restores the newest usable checkpoint (or `load_step`); damaged ones are reported and skipped.

        Returns its train state (step, data position, ...), or None when there is none to resume from.
        """
        if not self.enabled:
            return None
        steps = agreed_steps(self.folder)
        if self.config.load_step >= 0:
            if self.config.load_step not in steps:
                raise CheckpointError(
                    f"checkpoint.load_step {self.config.load_step} has no complete checkpoint in {self.folder} "
                    f"(complete: {steps or 'none'}); pick one of those or -1 for the latest"
                )
            return self.load(self.config.load_step, parts, optimizers, lr_schedulers, train_state)
        for step in reversed(steps):
            try:
                return self.load(step, parts, optimizers, lr_schedulers, train_state)
            except DamagedCheckpoint as e:
                logger.warning(f"skipping damaged checkpoint: {e}")
        if steps:
            raise CheckpointError(f"no usable checkpoint in {self.folder} (all of steps {steps} are damaged); "
                                  "move them away to start from scratch")
        return None

    def load(self, step: int, parts, optimizers, lr_schedulers, train_state: dict[str, int]) -> dict[str, int]:
        """Restores the states in place and returns the train state: the keys of `train_state` that the
        checkpoint holds."""
        path = self.folder / f"step-{step}"
        manifest = read_manifest(path)
        check_identity(path, manifest, self.identity)
        wanted = set(manifest.get("contents", ["model", "optimizer", "lr_scheduler", "train_state"]))
        wanted -= set(self.config.exclude_from_loading)
        state = self._state(parts, optimizers, lr_schedulers, train_state)
        state = {k: v for k, v in state.items() if k in wanted}
        if "train_state" in state:
            # Counters added after the checkpoint was written are not in it: the caller keeps its defaults.
            saved = agreed(lambda: set(_metadata(path).state_dict_metadata))
            state["train_state"] = {k: v for k, v in state["train_state"].items() if f"train_state.{k}" in saved}
        read_checkpoint(path, state)
        for part, opt, sched in zip(parts, optimizers, lr_schedulers):
            if "model" in state:
                set_model_state_dict(part, state["model"], options=PARTIAL)
            if "optimizer" in state:
                set_optimizer_state_dict(part, opt, state["optimizer"], options=FLAT)
            if "lr_scheduler" in state:
                sched.last_epoch = int(state["lr_scheduler"]["last_epoch"])
                sched._last_lr = [g["lr"] for g in opt.param_groups]
        train_state = {k: int(v) for k, v in state.get("train_state", {}).items()}
        logger.info(f"resumed from checkpoint {path} ({', '.join(sorted(state))})")
        return train_state

def _metadata(path: Path):
    try:
        return load_metadata(path)
    except UnsafeCheckpoint:
        raise
    except (ValueError, OSError) as e:
        raise DamagedCheckpoint(str(e)) from None


def _plain(state: dict[str, Any]) -> bool:
    """A module state dict whose names and tensors are already those of the full model: no shard (FSDP, TP) and
    no `_orig_mod.` (torch.compile; activation checkpointing's wrapper hides its own name), so DCP's per-name
    mapping would cost time and change nothing."""
    return not any(isinstance(v, DTensor) for v in state.values()) and not any("_orig_mod." in k for k in state)


def load_full_model_state_dict(model, full_state_dict: dict[str, torch.Tensor],
                               broadcast_from_rank0: bool = False) -> None:
    """Loads an unsharded state dict into a (possibly sharded) model; each rank keeps its own shard.

    With `broadcast_from_rank0` only rank 0 needs to hold the tensors; the others pass an empty dict.
    """
    if not broadcast_from_rank0 and _plain(model.state_dict()):
        model.load_state_dict(full_state_dict, strict=True)
        return
    options = StateDictOptions(full_state_dict=True, strict=True, broadcast_from_rank0=broadcast_from_rank0)
    set_model_state_dict(model, full_state_dict, options=options)


def full_model_state_dict(model) -> dict[str, torch.Tensor]:
    """The unsharded state dict on every rank (gathered from shards where needed), on the CPU.

    Not `cpu_offload=True`: that gathers to rank 0 only.
    """
    state = model.state_dict()
    if not _plain(state):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu() for k, v in state.items()}
