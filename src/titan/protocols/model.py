"""What the engine calls on a model it trains: initialization after `to_empty`, and the pipeline split."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class TrainableModel(Protocol):
    """A plain single-device model built on the meta device; the Trainer materializes it with `to_empty`."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Fills every parameter and buffer in place (a fresh run, no initial state dict)."""

    def init_buffers(self, buffer_device: torch.device | None = None) -> None:
        """Recomputes the non-persistent buffers (e.g. RoPE tables), which loaded state dicts lack."""


@runtime_checkable
class PipelineModel(TrainableModel, Protocol):
    """A model that pipeline parallel can split: its blocks in `layers`, the modules only the first and the last
    stage keep named; its forward skips the parts that are None (a middle stage maps hidden to hidden)."""

    layers: nn.ModuleDict
    pipeline_first_modules: tuple[str, ...]
    pipeline_last_modules: tuple[str, ...]


@runtime_checkable
class ContextParallelModel(Protocol):
    """A model with sequence-indexed buffers (e.g. the RoPE table, as long as training.seq_len) that context
    parallel shards along with the sequence."""

    context_parallel_buffers: tuple[str, ...]
