"""Per-block torch.compile: blocks are identical, so one compiled graph serves them all."""

from __future__ import annotations

import torch
from torch import nn

from titan.metrics.logging import logger


def apply_compile(model: nn.Module, compile_config) -> None:
    if not compile_config.enable:
        return
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend=compile_config.backend, fullgraph=True))
    logger.info(f"compiled {len(model.layers)} blocks with torch.compile({compile_config.backend})")
