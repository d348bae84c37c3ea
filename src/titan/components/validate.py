"""Validation: the mean loss (and the spec's metrics) over batches of the validation split."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titan.distributed.utils import (
    autocast_context,
    cp_context,
    loss_parallel_context,
    mean_over_loss_holders,
    replicated_value,
)
from titan.tools.cli import UserError

if TYPE_CHECKING:
    from titan.trainer import Trainer


def _eval_batch(trainer: Trainer, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    inputs, labels = inputs.clone(), labels.clone()
    contexts = (cp_context(trainer.parallel_dims, trainer.model_parts, inputs, labels),
                loss_parallel_context(trainer.parallel_dims, trainer.config.parallelism.enable_loss_parallel),
                autocast_context(trainer.device, trainer.sharded, trainer.autocast_dtype))
    with contexts[0], contexts[1], contexts[2]:
        if trainer.pp_schedule is not None:
            losses: list[torch.Tensor] = []
            placement = trainer.pp_placement
            trainer.pp_schedule.eval(*((inputs,) if placement.has_first else ()),
                                     target=labels if placement.has_last else None, losses=losses)
            if not placement.has_last:
                return {"loss": torch.zeros((), device=trainer.device)}
            return {"loss": torch.stack([replicated_value(x) for x in losses]).mean().float()
                    * trainer.pp_loss_scale}
        pred = trainer.model(inputs)
        values = {"loss": trainer.loss_fn(pred, labels).float()}
        if trainer.spec.metrics_fn is not None:
            values.update({k: v.float() for k, v in trainer.spec.metrics_fn(pred, labels).items()})
    return {k: replicated_value(v) for k, v in values.items()}


@torch.no_grad()
def evaluate(trainer: Trainer) -> dict[str, float]:
    """Mean loss (and spec metrics) over `validation.steps` batches (all of them when negative)."""
    loader = trainer.spec.build_dataloader(trainer.config, trainer.dp_rank, trainer.parallel_dims.dp_degree,
                                           trainer.tokenizer, "validation")
    limit = trainer.config.validation.steps
    for part in trainer.model_parts:
        part.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = 0
    for inputs, labels in loader:
        if 0 <= limit <= batches:
            break
        for k, v in _eval_batch(trainer, inputs.to(trainer.device), labels.to(trainer.device)).items():
            sums[k] = sums.get(k, 0) + v
        batches += 1
    for part in trainer.model_parts:
        part.train()
    if batches == 0:
        raise UserError("the validation split yielded no batch; lower training.local_batch_size/seq_len")
    names = list(sums)
    reduced = mean_over_loss_holders(torch.stack([sums[k] for k in names]) / batches, trainer.parallel_dims)
    return dict(zip(names, reduced.tolist()))
