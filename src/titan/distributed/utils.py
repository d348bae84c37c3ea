"""Collective helpers the training loop needs under any layout."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters: list[torch.Tensor], max_norm: float, pp_group=None) -> torch.Tensor:
    """Global L2 norm of the gradients (over all shards and pipeline stages), clipped in place to `max_norm`.

    Norms accumulate in float64: torch's float32 CPU norm of a million-element gradient is off by ~3e-4
    relative, enough to make layouts disagree on the clip factor.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norms = [torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        # Each pipeline rank holds other parameters: add the squares over stages.
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total.sqrt()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total.float(), foreach=True)
    return total
