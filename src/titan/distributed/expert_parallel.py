"""Expert parallel: each rank of an EP mesh holds num_experts / ep of every MoE layer's routed experts, and token
copies travel to their expert's rank and back by all-to-all with variable splits (gloo and NCCL alike).

    apply_expert_parallel(model, ep_mesh)           # the layer alone
    ignored = apply_moe_data_parallel(model, parallel_dims, job_config)  # in a family's parallelize, before FSDP
    apply_data_parallel(model, parallel_dims, job_config, ignored_params=ignored)

The experts' weights become DTensors sharded on the expert dim (Shard(0)), so optimizers, gradient clipping and
DCP see whole tensors whatever the EP degree. The model code stays single-device: the dispatch and combine are
a wrapper of each GroupedExperts' forward, whose (token copies sorted by expert, counts per expert) input and
output in the same order do not change. The router and shared experts stay replicated; their gradients are
summed over the ranks by data parallel, as for any replicated weight. Under tensor parallel the expert group holds
the TP ranks too (TorchTitan's etp=1): each TP rank dispatches its own sequence shard to experts no other TP rank
repeats, and apply_moe_data_parallel makes each MoE layer's gradients account for the other TP ranks' tokens.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from titan.config.dtypes import TORCH_DTYPES
from titan.distributed.data_parallel import reshard_after_forward
from titan.models.common.moe import GatherRows, MoE
from titan.tools.cli import UserError
from titan.tools.logging import logger

# A MoE layer returns its output reshaped to its input's shape, a view, which FSDP warns about at every step when
# the layer is its own unit (under tensor parallel); the blocks add it to the residual out of place, so no in-place
# op can skip FSDP's pre-backward hook.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPMoE\) returned a view tensor")


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
        # Functional collectives only: op-level activation checkpointing saves their outputs instead of
        # communicating again in the recompute (titan.distributed.activation_checkpoint).
        received_RL = funcol.wait_tensor(
            funcol.all_to_all_single(counts_RL.flatten(), None, None, self.group)).view_as(counts_RL)
        send, recv = counts_RL.sum(dim=1).tolist(), received_RL.sum(dim=1).tolist()
        x_MD = funcol.all_to_all_single_autograd(x_ND, recv, send, self.group)
        # Received rank by rank, each rank's copies by local expert: regroup by local expert, rank order within,
        # and back. Gathers both ways (a permutation's backward gathers by its inverse): indexing would differentiate
        # into an index_put with accumulate, one element at a time on the CPU.
        local = counts_RL.shape[1]
        expert_M = torch.repeat_interleave(torch.arange(local, device=x_ND.device).repeat(self.ep),
                                           received_RL.flatten())
        order_M = expert_M.argsort(stable=True)
        inverse_M = torch.empty_like(order_M).scatter_(0, order_M, torch.arange(len(order_M), device=x_ND.device))
        x_MD = GatherRows.apply(_ScaleGrad.apply(x_MD, float(self.ep)), order_M, inverse_M, 1)
        y_MD = self.local_forward(x_MD, received_RL.sum(dim=0))
        unsorted_MD = GatherRows.apply(_ScaleGrad.apply(y_MD, 1.0 / self.ep), inverse_M, order_M, 1)
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
    the experts' gradients over those ranks as FSDP does every other gradient.

    Under tensor parallel each TP rank's MoE layers route only that rank's sequence shard (the decoder's TP plan):
    a TP rank is then to a MoE layer what a data-parallel rank is, but its loss is the mean over all TP ranks'
    tokens, so the layer's gradients are scaled by the TP degree and averaged over the TP ranks too. Each layer
    becomes an FSDP unit over the data-parallel and TP ranks (dp_shard_cp_tp) for its router and shared experts;
    experts sharded by expert parallel are in no TP rank twice (the expert group holds the TP ranks), so their
    own unit's reduction over dp_shard_mod_ep is all they need. Returns the experts' parameters no FSDP unit holds
    (no data-parallel ranks outside the expert group), which the model's FSDP must leave alone."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers or not (parallel_dims.ep_enabled or parallel_dims.tp_enabled):
        return set()
    if parallel_dims.ep_enabled:
        apply_expert_parallel(model, parallel_dims.submesh("ep"))
    experts_mesh = _fsdp_mesh(parallel_dims, "dp_shard_mod_ep") if parallel_dims.ep_enabled else None
    layer_mesh = _fsdp_mesh(parallel_dims, "dp_shard_cp_tp") if parallel_dims.tp_enabled else None
    training = job_config.training
    # Without FSDP elsewhere the forward autocasts (titan.distributed.utils.autocast_context): no casts here.
    sharded = parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled
    mp_policy = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[training.mixed_precision_param],
                                     reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce]) if sharded \
        else MixedPrecisionPolicy()
    reshard = reshard_after_forward(parallel_dims, job_config)
    alone = set()
    for moe in layers:
        experts_alone = set()
        if experts_mesh is not None:
            # FSDP shards the expert dim; with fewer local experts than shards, some ranks would hold whole experts
            # and others none (DeepSeek-V3 on 512 ranks at EP 64: 4 experts over 8 shards), so it shards the next.
            dim = 1 if moe.args.num_experts // parallel_dims.ep < experts_mesh.size(experts_mesh.ndim - 1) else 0
            fully_shard(moe.experts, mesh=experts_mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                        shard_placement_fn=lambda _, dim=dim: Shard(dim))
        elif parallel_dims.ep_enabled:
            experts_alone = set(moe.experts.parameters())
            alone |= experts_alone
        if layer_mesh is not None:
            _scale_grads_by_tp(moe, parallel_dims.tp)
            fully_shard(moe, mesh=layer_mesh, mp_policy=mp_policy, reshard_after_forward=reshard,
                        ignored_params=experts_alone)
    units = [(k, m) for k, m in (("experts", experts_mesh), ("MoE layers", layer_mesh)) if m is not None]
    logger.info(f"MoE under expert parallel {parallel_dims.ep} and tensor parallel {parallel_dims.tp}: "
                + (", ".join(f"{k} FSDP over {dict(zip(m.mesh_dim_names, m.shape))}" for k, m in units)
                   or "experts sharded over the expert group only"))
    return alone


def _scale_grads_by_tp(moe: MoE, tp: int) -> None:
    """Scales the layer's gradients by the TP degree (the gradient back to its input unscaled): FSDP over a mesh
    with the TP ranks then averages the router's and shared experts'; expert-parallel experts, on one TP rank each,
    are divided by the expert group's size instead, which holds the TP ranks (_ExpertParallelForward)."""
    moe.register_forward_pre_hook(lambda _, args: (_ScaleGrad.apply(args[0], 1.0 / tp), *args[1:]))
    moe.register_forward_hook(lambda _, args, out: _ScaleGrad.apply(out, float(tp)))


def _fsdp_mesh(parallel_dims, view: str) -> DeviceMesh | None:
    """The mesh FSDP shards over: the ranks of `view` (a mesh dim or a flattened view), as HSDP with dp_replicate;
    None when neither has more than one rank."""
    shard = parallel_dims.submesh(view)
    if shard is None or not parallel_dims.dp_replicate_enabled:
        return shard if shard is not None else parallel_dims.submesh("dp_replicate")
    return parallel_dims.world_mesh[("dp_replicate", shard.mesh_dim_names[0])]
