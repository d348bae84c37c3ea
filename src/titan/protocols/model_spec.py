"""ModelSpec: everything the Trainer needs to know about a model family. The registry is `titan.models`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from titan.components.loss import cross_entropy_loss

if TYPE_CHECKING:
    from titan.config import JobConfig
    from titan.distributed.parallel_dims import ParallelDims


class StatefulLoader(Protocol):
    """A resumable iterator of `(inputs, labels)` batches local to one data-parallel rank."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class ModelSpec:
    """A model family: how to build, parallelize, feed and score it."""

    name: str
    """Registry key, matched against `model.name`."""
    flavors: Mapping[str, Any]
    """Flavor name -> model args (any object `build_model` accepts)."""
    build_model: Callable[[Any], nn.Module]
    """Builds the plain single-device model from args; called under the meta device. The model must define
    `init_weights()` (called after `to_empty`) unless the Trainer is given an initial state dict."""
    parallelize: Callable[[nn.Module, ParallelDims, JobConfig], nn.Module]
    """Parallelizes one model part in place and returns it, in the order titan.distributed.parallelize states
    (most families call that function with their TP plan)."""
    build_dataloader: Callable[..., StatefulLoader]
    """`(job_config, dp_rank, dp_degree, tokenizer, split) -> StatefulLoader`; split is "train" or "validation"."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_loss
    """`(model_output, labels) -> scalar loss` (mean over the local batch)."""
    build_tokenizer: Callable[[JobConfig], Any] | None = None
    """`job_config -> tokenizer`; None for models that take no text."""
    update_model_args: Callable[[Any, JobConfig, Any], Any] | None = None
    """`(args, job_config, tokenizer) -> args`, e.g. to set the vocabulary size from the tokenizer."""
    flops_per_token: Callable[[nn.Module, Any, int], float] | None = None
    """`(model, args, seq_len) -> training FLOPs per token`; None means 6 x parameters."""
    args_from_folder: Callable[[JobConfig], Any] | None = None
    """`job_config -> args` for `model.flavor = "hf"`: the architecture of the Hugging Face folder the config names."""
    load_hf_weights: Callable[[Path, Any], dict[str, torch.Tensor]] | None = None
    """`(folder, args) -> state dict`: a Hugging Face folder's weights in this model's names, for
    `checkpoint.initial_load_path` with `checkpoint.initial_load_in_hf`."""
    check_layout: Callable[[Any, ParallelDims, JobConfig], None] | None = None
    """`(args, parallel_dims, job_config)`: the family's rules for a layout (e.g. TP must divide the heads), checked
    with the run's other rules before anything is built (titan.builders.check_run) and by the estimator."""
    metrics_fn: Callable[[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]] | None = None
    """Extra per-batch metrics beside the loss (e.g. accuracy), each a scalar tensor averaged over ranks."""
