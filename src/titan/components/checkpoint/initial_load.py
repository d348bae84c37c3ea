"""A run's starting weights from outside its checkpoint folder (`checkpoint.initial_load_path`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from titan.components.checkpoint.manager import complete_steps
from titan.tools.cli import UserError
from titan.tools.logging import logger


def check_initial_load(checkpoint_config) -> None:
    """What the config asks of initial_load_path that this engine cannot do, before any work."""
    if checkpoint_config.initial_load_path and not checkpoint_config.initial_load_in_hf:
        raise UserError("checkpoint.initial_load_path loads Hugging Face folders here: add "
                         "--checkpoint.initial_load_in_hf (a DCP step folder resumes from checkpoint.folder)")
    if checkpoint_config.initial_load_in_hf and not checkpoint_config.initial_load_path:
        raise UserError("checkpoint.initial_load_in_hf needs checkpoint.initial_load_path, the Hugging Face folder")


def initial_state_dict(spec, job_config, model_args: Any, checkpoint_folder: Path) -> dict[str, torch.Tensor] | None:
    """The HF folder's weights, unless there is none to load or the run resumes from its own checkpoint."""
    ckpt = job_config.checkpoint
    check_initial_load(ckpt)
    if not ckpt.initial_load_path:
        return None
    if ckpt.enable and not ckpt.create_seed_checkpoint and complete_steps(checkpoint_folder):
        return None  # the run's own checkpoint wins, as on a restart
    if spec.load_hf_weights is None:
        raise UserError(f"checkpoint.initial_load_in_hf: model {spec.name} has no Hugging Face format")
    # Master weights are fp32 whatever the files hold.
    state = {k: v.float() for k, v in spec.load_hf_weights(Path(ckpt.initial_load_path), model_args).items()}
    logger.info(f"initial weights: {len(state)} tensors from {ckpt.initial_load_path} (Hugging Face)")
    return state
