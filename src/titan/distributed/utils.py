"""Collectives and contexts the training step needs under any layout."""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import loss_parallel


def _spec_key(t: torch.Tensor):
    return (t.device_mesh, t.placements) if isinstance(t, DTensor) else None


def clip_grad_norm_(parameters: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (over all shards and pipeline stages), clipped in place to `max_norm`.

    The result stays on the device (no host sync). Norms accumulate in float64: torch's float32 CPU norm of a
    million-element gradient is off by ~3e-4 relative, enough to make layouts disagree on the clip factor.
    Gradients may mix plain tensors and DTensors on different meshes (e.g. replicated and sharded parameters of
    one model): each kind is reduced on its own, one `_foreach_norm` over its local shards, then the squares are
    added.
    """
    groups: dict = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[_spec_key(p.grad)].append(p)
    device = parameters[0].device if parameters else torch.device("cpu")
    total_sq = torch.zeros((), dtype=torch.float64, device=device)
    for key, params in groups.items():
        grads = [p.grad for p in params]
        if key is not None:
            # DTensor's own _foreach_norm rejects dtype: norms of the local shards, their squares summed over the
            # mesh dims that shard. Unreduced (partial) gradients, e.g. of norms under sequence parallel, are
            # reduced first.
            mesh, placements = key
            if any(pl.is_partial() for pl in placements):
                placements = tuple(Replicate() if pl.is_partial() else pl for pl in placements)
                grads = [g.redistribute(mesh, placements) for g in grads]
            grads = [g.to_local() for g in grads]
        group_sq = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))) ** 2
        if key is not None:
            summed = [Partial("sum") if pl.is_shard() else Replicate() for pl in placements]
            group_sq = DTensor.from_local(group_sq, mesh, summed).full_tensor()
        total_sq = total_sq + group_sq.to(device)
    if pp_group is not None:
        # Each pipeline rank holds other parameters: add the squares over stages.
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.float(), foreach=True)
    return total


def autocast_context(device: torch.device, sharded: bool, dtype: torch.dtype):
    """Mixed precision of the forward: with FSDP its policy casts the parameters; a single process autocasts."""
    if sharded or dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def loss_parallel_context(parallel_dims, enabled: bool):
    """Loss parallel: cross-entropy on vocabulary-sharded logits, never gathering them."""
    return loss_parallel() if parallel_dims.tp_enabled and enabled else nullcontext()


def cp_context(parallel_dims, model_parts: list, inputs: torch.Tensor, labels: torch.Tensor):
    """Context parallel: this rank computes on its (load-balanced) share of the sequence."""
    if not parallel_dims.cp_enabled:
        return nullcontext()
    from titan.distributed.context_parallel import sequence_sharded

    return sequence_sharded(parallel_dims.world_mesh["cp"], model_parts, inputs, labels)


def mean_over_loss_holders(values: torch.Tensor, parallel_dims) -> torch.Tensor:
    """Mean over the ranks that hold the values: all ranks, or under pipeline parallel the last stages."""
    if parallel_dims.world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        values /= dist.get_world_size() // parallel_dims.pp
    return values


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A scalar that loss parallel returns as a replicated DTensor, as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t
