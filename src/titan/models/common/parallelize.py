"""Parallelizing a `Decoder` (every family built on the toolkit): its TP/SP plan, what that plan cannot shard, and
the parallelize function of each family's ModelSpec."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan.distributed.parallelize import parallelize
from titan.tools.cli import UserError
from titan.tools.logging import logger


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, loss_parallel: bool) -> None:
    """Megatron-style TP with sequence-parallel norms; the output layer is sharded on the vocabulary."""
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
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        if block.attention.q_norm is not None:
            # Each rank holds some heads (B, T, heads, head_dim): the per-head norm weight is replicated and its
            # gradient, partial per rank, is summed over the TP group, as sequence parallel does over tokens.
            plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
    logger.info(f"applied tensor + sequence parallel (degree {tp_mesh.size()}, loss parallel {loss_parallel})")


def check_decoder_layout(args, parallel_dims, job_config) -> None:
    """What a decoder's parallelization cannot shard: one line naming the fix (a run rule, see titan.builders)."""
    if args.tie_embeddings and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        # The embedding and the output matmul would hold differently sharded copies of the one tied matrix.
        raise UserError("tied embeddings (model.tie_embeddings) train with FSDP/HSDP and context parallel; drop "
                         "tensor/pipeline parallel or pass --model.tie_embeddings false")
    kv = args.n_kv_heads or args.n_heads
    if parallel_dims.tp_enabled and (args.n_heads % parallel_dims.tp or kv % parallel_dims.tp):
        raise UserError(f"tensor_parallel_degree {parallel_dims.tp} must divide n_heads {args.n_heads} and "
                         f"n_kv_heads {kv}")


def parallelize_decoder(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """The engine's parallelization (titan.distributed.parallelize) with the decoder's TP plan."""
    return parallelize(model, parallel_dims, job_config, apply_tp)


def check_sparse_decoder_layout(args, parallel_dims, job_config) -> None:
    """The layout rule of decoders with experts or latent attention: tensor parallel with them is not built yet
    (FSDP/HSDP, expert, pipeline and context parallel, compile and float8 are)."""
    if parallel_dims.tp_enabled:
        raise UserError(f"{type(args).__name__} (experts or latent attention) trains with FSDP/HSDP and expert, "
                        "pipeline and context parallel; tensor parallelism with it is not built yet: drop it")
