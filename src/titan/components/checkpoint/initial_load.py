"""A run's starting weights from outside its checkpoint folder (`checkpoint.initial_load_path`).

Either a Hugging Face folder (with `checkpoint.initial_load_in_hf`), read into a full state dict before the
model is built, or a DCP step folder (a titan `checkpoint/step-N`, or TorchTitan's, whose model weights sit at
the top level beside "optimizer", "train_state", ...), read into the built, sharded model: as TorchTitan's
`initial_load_model_only`, only the weights load, and the run starts at step 0 with a fresh optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from titan.components.checkpoint.manager import PARTIAL, TMP_DIR, agreed_steps, complete_steps
from titan.components.checkpoint.reader import (
    MANIFEST,
    CheckpointError,
    DamagedCheckpoint,
    load_verified,
    read_manifest,
    verify,
)
from titan.components.checkpoint.safe_reader import load_metadata, metadata_problem
from titan.tools.agreement import agree, agreed
from titan.tools.cli import UserError
from titan.tools.logging import logger

KEY = "checkpoint.initial_load_path"


def check_initial_load(checkpoint_config) -> None:
    """What the config asks of initial_load_path that this engine cannot do, before any work."""
    if checkpoint_config.initial_load_in_hf and not checkpoint_config.initial_load_path:
        raise UserError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path, the Hugging Face folder")


def _wanted(ckpt, checkpoint_folder: Path) -> bool:
    check_initial_load(ckpt)
    if not ckpt.initial_load_path:
        return False
    # The run's own checkpoint wins, as on a restart (TorchTitan ignores initial_load_path then too).
    return not (ckpt.enable and not ckpt.create_seed_checkpoint and agreed_steps(checkpoint_folder))


def initial_state_dict(spec, job_config, model_args: Any, checkpoint_folder: Path) -> dict[str, torch.Tensor] | None:
    """The HF folder's weights, unless there is none to load or the run resumes from its own checkpoint."""
    ckpt = job_config.checkpoint
    if not _wanted(ckpt, checkpoint_folder) or not ckpt.initial_load_in_hf:
        return None
    if spec.load_hf_weights is None:
        raise UserError(f"checkpoint.initial_load_in_hf: model {spec.name} has no Hugging Face format")
    # Master weights are fp32 whatever the files hold.
    state = {k: v.float() for k, v in spec.load_hf_weights(Path(ckpt.initial_load_path), model_args).items()}
    logger.info(f"initial weights: {len(state)} tensors from {ckpt.initial_load_path} (Hugging Face)")
    return state


def _not_a_step_folder(path: Path) -> str:
    """Why `path` (without a .metadata) is no DCP checkpoint, and what to point at instead."""
    if not path.is_dir():
        return (f"{KEY} {path} does not exist; point it at a checkpoint step folder (e.g. "
                "outputs/<job>/checkpoint/step-1000) or, with --checkpoint.initial_load_in_hf, a Hugging Face folder")
    steps = complete_steps(path)
    if steps:
        return f"{KEY} {path} is a checkpoint folder: point it at one of its steps, e.g. {path / f'step-{steps[-1]}'}"
    if (path / "config.json").is_file():
        return f"{KEY} {path} looks like a Hugging Face folder (config.json): add --checkpoint.initial_load_in_hf"
    return (f"{KEY} {path} holds no DCP checkpoint (no .metadata file); point it at a checkpoint step folder, or "
            "add --checkpoint.initial_load_in_hf for a Hugging Face folder")


def _step_folder(path: Path) -> bool:
    """Whether the folder holds titan's manifest, after checking that it is a DCP step folder at all."""
    if TMP_DIR.match(path.name):
        raise CheckpointError(f"{KEY} {path} is an unfinished save (.tmp); point it at a complete step folder")
    if not (path / ".metadata").is_file():
        raise CheckpointError(_not_a_step_folder(path))
    return (path / MANIFEST).is_file()


def checked_layout(path: Path) -> str:
    """The key prefix of the model's weights in the DCP folder ("model." for titan's, "" for TorchTitan's),
    after checking its files: a titan folder against its manifest, any folder's metadata against its shards.
    Every rank reaches the same outcome (a problem one rank sees is every rank's)."""
    if agreed(lambda: _step_folder(path)):
        manifest = read_manifest(path)
        if "model" not in manifest.get("contents", ["model"]):
            raise CheckpointError(f"{KEY} {path} holds no model weights ({', '.join(manifest['contents'])})")
        verify(path, manifest)
        return "model."
    if problem := agree(agreed(lambda: metadata_problem(path))):
        raise DamagedCheckpoint(f"checkpoint {path}: {problem}")
    saved = agreed(lambda: load_metadata(path)).state_dict_metadata
    # A titan folder that lost its manifest still has its nested keys.
    return "model." if any(k.startswith("model.") for k in saved) else ""


def check_shapes(path: Path, prefix: str, state: dict[str, torch.Tensor]) -> None:
    """Every weight of the model is in the folder with the model's (unsharded) shape, else one line naming it."""
    saved = load_metadata(path).state_dict_metadata
    missing = [k for k in state if not isinstance(saved.get(prefix + k), TensorStorageMetadata)]
    if missing:
        example = next((k for k, v in saved.items() if isinstance(v, TensorStorageMetadata)), "nothing")
        raise CheckpointError(
            f"{KEY} {path} has no {missing[0]} ({len(missing)} of the model's {len(state)} weights are missing; "
            f"its tensors are named like {example}): is it a checkpoint of this model (model.name, model.flavor)?")
    for key, value in state.items():
        shape = tuple(saved[prefix + key].size)
        if shape != tuple(value.shape):
            raise CheckpointError(
                f"{KEY} {path}: {key} has shape {list(shape)} there, the model needs {list(value.shape)}; set the "
                "model.flavor / model.* keys it was trained with")


def initial_checkpoint(job_config, checkpoint_folder: Path) -> tuple[Path, str] | None:
    """The DCP step folder to take the model weights from and its key prefix, its files checked (before the model
    is built); None when there is none to load (no path, an HF folder, or the run resumes from its own)."""
    ckpt = job_config.checkpoint
    if not _wanted(ckpt, checkpoint_folder) or ckpt.initial_load_in_hf:
        return None
    path = Path(ckpt.initial_load_path)
    return path, checked_layout(path)


def load_initial_checkpoint(parts: list[nn.Module], path: Path, prefix: str) -> None:
    """Loads the model weights (only) of the checked DCP step folder into the built parts."""
    # Full-model names whatever this rank holds (pipeline stages); values are its shards, resharded by DCP.
    weights: dict[str, torch.Tensor] = {}
    for part in parts:
        weights.update(get_model_state_dict(part))
    agreed(lambda: check_shapes(path, prefix, weights))
    load_verified(path, {"model": weights} if prefix else weights)
    for part in parts:
        set_model_state_dict(part, weights, options=PARTIAL)
    logger.info(f"initial weights: {len(weights)} tensors from {path} (DCP, model only; training starts at step 0)")
