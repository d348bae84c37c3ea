"""The default training loss."""

import torch
from torch import nn


def cross_entropy_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32; `pred` is (..., V) logits, `labels` matches its leading dims."""
    return nn.functional.cross_entropy(pred.flatten(0, -2).float(), labels.flatten(0, -1))
