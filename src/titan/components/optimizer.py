"""Optimizer and learning-rate schedule (linear warmup, optional stable phase, then decay)."""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn


def build_optimizer(model: nn.Module, opt_config) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    style = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}
    kwargs = style[opt_config.implementation]
    if opt_config.name == "SGD":
        return torch.optim.SGD(params, lr=opt_config.lr, momentum=opt_config.momentum,
                               weight_decay=opt_config.weight_decay, **kwargs)
    cls = torch.optim.AdamW if opt_config.name == "AdamW" else torch.optim.Adam
    return cls(params, lr=opt_config.lr, betas=(opt_config.beta1, opt_config.beta2), eps=opt_config.eps,
               weight_decay=opt_config.weight_decay, **kwargs)


def lr_factor(step: int, warmup_steps: int, decay_steps: int, total_steps: int, decay_type: str,
              min_factor: float) -> float:
    """Multiplier of the peak lr for the optimizer step that follows `step` completed steps."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay_start = total_steps - decay_steps
    if step < decay_start or decay_steps == 0:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_factor + (1.0 - min_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, sched_config, total_steps: int):
    """`total_steps`: the run's training.steps, unless lr_scheduler.total_steps sets the schedule's own length."""
    total_steps = sched_config.total_steps or total_steps
    warmup = min(sched_config.warmup_steps, total_steps)
    after_warmup = total_steps - warmup
    decay = after_warmup if sched_config.decay_ratio < 0 else int(round(after_warmup * sched_config.decay_ratio))
    fn = partial(lr_factor, warmup_steps=warmup, decay_steps=decay, total_steps=total_steps,
                 decay_type=sched_config.decay_type, min_factor=sched_config.min_lr_factor)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
