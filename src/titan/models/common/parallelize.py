"""Parallelizing a `Decoder` (every family built on the toolkit): TP/SP plans, async TP, float8, and the one
function each family's ModelSpec uses, which applies them in the engine's order (see titan.distributed)."""

from __future__ import annotations

import warnings

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

from titan.distributed import apply_ac, apply_compile, apply_data_parallel
from titan.quantization.float8 import apply_float8, enable_float8_all_gather
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


def apply_async_tp(tp_mesh: DeviceMesh) -> None:
    """Lets inductor's micro-pipeline pass split TP all-gather/reduce-scatter + matmul pairs into overlapped chunks."""
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    # Deprecated as "no longer needed" in torch 2.14, yet the pass still skips groups that
    # is_symm_mem_enabled_for_group() does not know, and only this call registers one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("async tensor parallel: symmetric memory on the TP group, inductor micro-pipelining on")


def apply_float8_all_gather(model: nn.Module, parallel_dims) -> None:
    if not (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled):
        logger.info("float8 all-gather: no FSDP on this layout, nothing to gather")
        return
    logger.info(f"float8 all-gather: {enable_float8_all_gather(model)} weights will be all-gathered in float8")


def parallelize_decoder(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """Float8 -> TP/SP -> activation checkpointing -> compile -> FSDP/HSDP, in place; context parallel is applied
    around each step by the forward path, on the `context_parallel_buffers`."""
    if model.args.tie_embeddings and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        # The embedding and the output matmul would hold differently sharded copies of the one tied matrix.
        raise UserError("tied embeddings (model.tie_embeddings) train with FSDP/HSDP and context parallel; drop "
                         "tensor/pipeline parallel or pass --model.tie_embeddings false")
    apply_float8(model, job_config.float8)
    if parallel_dims.tp_enabled:
        args = model.args
        tp = parallel_dims.tp
        kv = args.n_kv_heads or args.n_heads
        if args.n_heads % tp or kv % tp:
            raise UserError(f"tensor_parallel_degree {tp} must divide n_heads {args.n_heads} and n_kv_heads {kv}")
        tp_mesh = parallel_dims.world_mesh["tp"]
        apply_tp(model, tp_mesh, job_config.parallelism.enable_loss_parallel)
        if job_config.parallelism.enable_async_tensor_parallel:
            apply_async_tp(tp_mesh)
    apply_ac(model, job_config.activation_checkpoint)
    apply_compile(model, job_config.compile)
    if job_config.float8.enable_fsdp_float8_all_gather:
        apply_float8_all_gather(model, parallel_dims)
    apply_data_parallel(model, parallel_dims, job_config)
    return model
