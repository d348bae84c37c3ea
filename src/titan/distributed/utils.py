"""Collective helpers the training loop needs under any layout."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _spec_key(t: torch.Tensor):
    return (t.device_mesh, t.placements) if isinstance(t, DTensor) else None


def clip_grad_norm_(parameters: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (over all shards and pipeline stages), clipped in place to `max_norm`.

    Norms accumulate in float64: torch's float32 CPU norm of a million-element gradient is off by ~3e-4
    relative, enough to make layouts disagree on the clip factor. Gradients may mix plain tensors and
    DTensors on different meshes (e.g. replicated and sharded parameters of one model): each kind is reduced
    on its own, then the squares are added.
    """
    groups: dict = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[_spec_key(p.grad)].append(p)
    total_sq = torch.zeros((), dtype=torch.float64)
    for params in groups.values():
        norms = torch.stack([torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in params])
        group_norm = torch.linalg.vector_norm(norms)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()
        total_sq = total_sq.to(group_norm.device) + group_norm**2
    if pp_group is not None:
        # Each pipeline rank holds other parameters: add the squares over stages.
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.float(), foreach=True)
    return total
