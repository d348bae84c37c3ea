"""Validation: the mean loss (and the spec's metrics) over batches of the validation split."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from titan.components.forward import ForwardPath
from titan.distributed.utils import mean_over_loss_holders
from titan.tools.cli import UserError


@torch.no_grad()
def evaluate(forward: ForwardPath, loader: Iterable, steps: int) -> dict[str, float]:
    """Mean loss (and spec metrics) over the first `steps` batches of `loader` (all of them when negative), the
    model in eval mode meanwhile."""
    for part in forward.parts:
        part.eval()
    sums: dict[str, torch.Tensor] = {}
    batches = 0
    for inputs, labels in loader:
        if 0 <= steps <= batches:
            break
        # Context parallel shards these in place: give it tensors of our own.
        values = forward.evaluate(inputs.to(forward.device).clone(), labels.to(forward.device).clone())
        for k, v in values.items():
            sums[k] = sums.get(k, 0) + v
        batches += 1
    for part in forward.parts:
        part.train()
    if batches == 0:
        raise UserError("the validation split yielded no batch; lower training.local_batch_size/seq_len")
    names = list(sums)
    reduced = mean_over_loss_holders(torch.stack([sums[k] for k in names]) / batches, forward.parallel_dims)
    return dict(zip(names, reduced.tolist()))
