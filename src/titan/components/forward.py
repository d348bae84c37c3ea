"""The one way a batch goes through this rank's model parts, in training and in evaluation alike: context-parallel
sharding of the sequence, loss parallel, autocast, and the pipeline schedule when the model is split in stages."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from titan.distributed.pipeline import build_schedule, microbatch_count
from titan.distributed.utils import autocast_context, cp_context, loss_parallel_context, replicated_value
from titan.models.common.moe_load import set_aux_loss_scale


class ForwardPath:
    """This rank's model parts and how a batch runs through them; the Trainer and the validator share it.

    A loss is that of one batch, replicated so that every rank holding it has the same value; pipeline ranks
    without the last stage return zero (they hold no loss)."""

    def __init__(self, parts: list[nn.Module], placement, parallel_dims, job_config, device: torch.device,
                 loss_fn: Callable, metrics_fn: Callable | None, grad_accum_steps: int, autocast_dtype: torch.dtype):
        self.parts, self.placement, self.parallel_dims, self.device = parts, placement, parallel_dims, device
        self.loss_fn, self.metrics_fn = loss_fn, metrics_fn
        self.grad_accum_steps = grad_accum_steps
        self.loss_parallel = job_config.parallelism.enable_loss_parallel
        sharded = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
        self.autocast = lambda: autocast_context(device, sharded, autocast_dtype)
        self.schedule = None
        # Gradients sum over microbatches and accumulation steps: each microbatch loss is scaled to get their mean,
        # and so is a MoE layer's balance loss, one of each forward batch.
        self.loss_scale = grad_accum_steps * (microbatch_count(job_config) if placement is not None else 1)
        set_aux_loss_scale(parts, 1 / self.loss_scale,
                           parallel_dims.world_mesh["cp"].get_group() if parallel_dims.cp_enabled else None)
        if placement is not None:
            self.schedule = build_schedule(parts, placement.stage_ids, placement.num_stages, parallel_dims,
                                           job_config, device, lambda pred, labels: loss_fn(pred, labels)
                                           / self.loss_scale)

    def _sharded(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Context parallel shards `inputs` and `labels` in place for the block; loss parallel around it."""
        stack = contextlib.ExitStack()
        stack.enter_context(cp_context(self.parallel_dims, self.parts, inputs, labels))
        stack.enter_context(loss_parallel_context(self.parallel_dims, self.loss_parallel))
        return stack

    def _pipeline(self, run: Callable, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        with self.autocast():
            run(*((inputs,) if self.placement.has_first else ()),
                target=labels if self.placement.has_last else None, losses=losses)
        if not self.placement.has_last:
            return torch.zeros((), device=self.device)
        return torch.stack([replicated_value(x.detach()) for x in losses]).mean().float() * self.loss_scale

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor,
                         poison: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loss of one micro-batch, its gradients accumulated (scaled by the accumulation steps), and the model
        output (None under a pipeline). `poison` makes the loss NaN (fault injection)."""
        with self._sharded(inputs, labels):
            if self.schedule is not None:
                return self._pipeline(self.schedule.step, inputs, labels), None
            with self.autocast():
                pred = self.parts[0](inputs)
                loss = self.loss_fn(pred, labels)
                if poison:
                    loss = loss * float("nan")
            (loss / self.grad_accum_steps).backward()
        return replicated_value(loss.detach()), pred.detach()

    @torch.no_grad()
    def evaluate(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """The loss (and the spec's metrics, without a pipeline) of one batch, without gradients."""
        with self._sharded(inputs, labels):
            if self.schedule is not None:
                return {"loss": self._pipeline(self.schedule.eval, inputs, labels)}
            with self.autocast():
                pred = self.parts[0](inputs)
                values = {"loss": self.loss_fn(pred, labels).float()}
                if self.metrics_fn is not None:
                    values.update({k: v.float() for k, v in self.metrics_fn(pred, labels).items()})
        return {k: replicated_value(v) for k, v in values.items()}
