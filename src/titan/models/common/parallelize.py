"""Parallelizing a `Decoder` (every family built on the toolkit): its TP/SP plan, what that plan cannot shard, and
the parallelize function of each family's ModelSpec."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan.distributed.parallelize import parallelize
from titan.models.common.mla import MLA
from titan.models.common.moe import MoE
from titan.tools.cli import UserError
from titan.tools.logging import logger


class ReplicateParallel(ParallelStyle):
    """The module's parameters replicated over the TP group as DTensors, its inputs and outputs DTensors too: where
    the ranks' heads send back partial gradients, DTensor sums them (MLA's low-rank projections and their norms)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence-parallel norms; the output layer is sharded on the vocabulary. Attention is
    sharded by heads, dense feed-forwards by their hidden units; a mixture of experts runs on the rank's own
    sequence shard, with no TP communication (its gradients are summed over TP by its own FSDP units:
    titan.distributed.expert_parallel)."""
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1),
                                  output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    # A pipeline stage holds only some of these modules.
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        attention = _mla_plan(block.attention) if isinstance(block.attention, MLA) else _gqa_plan(block.attention)
        plan = {"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(), **attention}
        # Qwen3-MoE's experts replace the feed-forward; DeepSeek-V3's blocks have either one.
        for name in ("feed_forward", "moe"):
            ffn = getattr(block, name, None)
            if isinstance(ffn, MoE):
                plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                use_local_output=True)
            elif ffn is not None:
                plan |= {name: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                         f"{name}.w1": ColwiseParallel(), f"{name}.w2": RowwiseParallel(output_layouts=Shard(1)),
                         f"{name}.w3": ColwiseParallel()}
        parallelize_module(block, tp_mesh, plan)
    logger.info(f"applied tensor + sequence parallel (degree {tp_mesh.size()}, loss parallel {loss_parallel})")


def _gqa_plan(attention: nn.Module) -> dict:
    plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.q_norm is not None:
        # Each rank holds some heads (B, T, heads, head_dim): the per-head norm weight is replicated and its
        # gradient, partial per rank, is summed over the TP group, as sequence parallel does over tokens.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def _mla_plan(attention: MLA) -> dict:
    """The up-projections by heads, the low-rank down-projections and their norms replicated (as TorchTitan does).
    The heads stay DTensors up to the attention kernel, so the key's rotary part, which all heads share, gets its
    gradient summed over the ranks' heads."""
    plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate()),
                                        desired_input_layouts=(Replicate(), Replicate())),
        "attention.wkv_a": ReplicateParallel(),
        "attention.kv_norm": ReplicateParallel(),
        "attention.wkv_b": ColwiseParallel(use_local_output=False),
        "attention.inner_attention": PrepareModuleInput(input_layouts=(Shard(1),) * 3,
                                                        desired_input_layouts=(Shard(1),) * 3, use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }
    if attention.args.q_lora_rank:
        plan |= {"attention.wq_a": ReplicateParallel(), "attention.q_norm": ReplicateParallel(),
                 "attention.wq_b": ColwiseParallel(use_local_output=False)}
    else:
        plan["attention.wq"] = ColwiseParallel(use_local_output=False)
    return plan


def check_decoder_layout(args, parallel_dims, job_config) -> None:
    """What a decoder's parallelization cannot shard: one line naming the fix (a run rule, see titan.builders)."""
    if args.tie_embeddings and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        # The embedding and the output matmul would hold differently sharded copies of the one tied matrix.
        raise UserError("tied embeddings (model.tie_embeddings) train with FSDP/HSDP and context parallel; drop "
                         "tensor/pipeline parallel or pass --model.tie_embeddings false")
    # Latent attention (DeepSeek-V3) has no key/value heads of its own.
    heads = {n: getattr(args, n) or args.n_heads for n in ("n_heads", "n_kv_heads") if hasattr(args, n)}
    if parallel_dims.tp_enabled and any(h % parallel_dims.tp for h in heads.values()):
        raise UserError(f"tensor_parallel_degree {parallel_dims.tp} must divide "
                        + " and ".join(f"{n} {h}" for n, h in heads.items()))


def parallelize_decoder(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """The engine's parallelization (titan.distributed.parallelize) with the decoder's TP plan."""
    return parallelize(model, parallel_dims, job_config, apply_tp)

