"""Expert parallel: each rank of an EP mesh holds num_experts / ep of every MoE layer's routed experts, and token
copies travel to their expert's rank and back by all-to-all with variable splits (gloo and NCCL alike).

    apply_expert_parallel(model, ep_mesh)           # the layer alone
    ignored = apply_moe_data_parallel(model, parallel_dims, job_config)  # in a family's parallelize, before FSDP
    apply_data_parallel(model, parallel_dims, job_config, ignored_params=ignored)

The experts' weights become DTensors sharded on the expert dim (Shard(0)), so optimizers, gradient clipping and
DCP see whole tensors whatever the EP degree. The model code stays single-device: the dispatch and combine are
a wrapper of each GroupedExperts' forward, whose (token copies sorted by expert, counts per expert) input and
output in the same order do not change. The router and shared experts stay replicated; their gradients are
summed over the ranks by data parallel, as for any replicated weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from titan.config.dtypes import TORCH_DTYPES
from titan.distributed.data_parallel import reshard_after_forward
from titan.models.common.moe import MoE
from titan.tools.cli import UserError
from titan.tools.logging import logger


class _ExpertParallelForward:
    """A GroupedExperts' forward under expert parallel: token copies go to their experts' ranks, regrouped by local
    expert, through the local experts, and back in their order. One call holds all of its state: no side effect
    for torch.compile to refuse (in an activation-checkpointed block, say)."""

    def __init__(self, local_forward, mesh: DeviceMesh):
        self.local_forward = local_forward
        self.group = mesh.get_group()
        self.ep = mesh.size()

    # Each rank's loss is a mean over its own tokens, and data parallel averages gradients over the ranks; an
    # expert's gradient instead sums the expert group's tokens over the all-to-all. So the gradient into the
    # experts is divided by the group size, and the one back to the tokens multiplied again.

    def __call__(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        counts_RL = counts_E.view(self.ep, -1)  # copies this rank sends to each rank's local experts
        received_RL = torch.empty_like(counts_RL)
        dist.all_to_all_single(received_RL, counts_RL, group=self.group)
        send, recv = counts_RL.sum(dim=1).tolist(), received_RL.sum(dim=1).tolist()
        x_MD = funcol.all_to_all_single_autograd(x_ND, recv, send, self.group)
        # Received rank by rank, each rank's copies by local expert: regroup by local expert, rank order within.
        local = counts_RL.shape[1]
        expert_M = torch.repeat_interleave(torch.arange(local, device=x_ND.device).repeat(self.ep),
                                           received_RL.flatten())
        order_M = expert_M.argsort(stable=True)
        y_MD = self.local_forward(_ScaleGrad.apply(x_MD, float(self.ep))[order_M], received_RL.sum(dim=0))
        unsorted_MD = torch.empty_like(y_MD).index_put((order_M,), _ScaleGrad.apply(y_MD, 1.0 / self.ep))
        return funcol.wait_tensor(funcol.all_to_all_single_autograd(unsorted_MD, send, recv, self.group))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Shards every MoE layer's routed experts over the 1-D `ep_mesh` (on meta or real tensors) and installs the
    all-to-all dispatch; returns how many layers it changed."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        if moe.args.num_experts % ep_mesh.size():
            raise UserError(f"expert_parallel_degree {ep_mesh.size()} must divide the number of experts "
                            f"{moe.args.num_experts}")
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(distribute_tensor(param.data, ep_mesh, [Shard(0)]),
                                                          requires_grad=param.requires_grad))
        experts.forward = _ExpertParallelForward(experts.forward, ep_mesh)
    return len(layers)


def apply_moe_data_parallel(model: nn.Module, parallel_dims, job_config) -> set[nn.Parameter]:
    """Expert parallel over parallel_dims' ep mesh, then FSDP of each MoE layer's experts over the data-parallel
    ranks outside the expert group (dp_shard_mod_ep, and dp_replicate as HSDP), as their own units, which average
    the experts' gradients over those ranks as FSDP does every other gradient. Returns the experts' parameters no
    FSDP unit holds (no such ranks), which the model's FSDP must leave alone."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or not parallel_dims.ep_enabled:
        return set()
    apply_expert_parallel(model, parallel_dims.submesh("ep"))
    names = [n for n in ("dp_replicate", "dp_shard_mod_ep") if n in parallel_dims.world_mesh.mesh_dim_names]
    if not names:
        logger.info(f"expert parallel {parallel_dims.ep}: experts sharded over the expert group only")
        return {p for moe in layers for p in moe.experts.parameters()}
    training = job_config.training
    mp_policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[training.mixed_precision_param],
                                     reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce])
    mesh = parallel_dims.world_mesh[tuple(names)]
    for moe in layers:
        fully_shard(moe.experts, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward(parallel_dims, job_config))
    logger.info(f"expert parallel {parallel_dims.ep}: experts FSDP over {dict(zip(names, mesh.shape))}")
    return set()
