"""The Hyena LM as a titan ModelSpec named `hyena`: `model.name = "hyena"`, `model.spec = "lcsm.hyena"`."""

from __future__ import annotations

import dataclasses

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from lcsm.model.hyena import HyenaArgs, HyenaLM, flops_per_token
from titan.components.data import build_text_dataloader, build_tokenizer
from titan.distributed.parallelize import parallelize
from titan.models import register_model_spec
from titan.protocols.model_spec import ModelSpec
from titan.tools.logging import logger

hyena_flavors = {
    "debug": HyenaArgs(dim=128, n_layers=4, vocab_size=4096, max_seq_len=1024, filter_hidden=32),
    # The Hyena-153M configuration (GPT-2 scale): 18 layers of width 864, order 2, 1024-token filters.
    "153M": HyenaArgs(dim=864, n_layers=18, vocab_size=50257, max_seq_len=1024, filter_hidden=64),
}


def update_model_args(args: HyenaArgs, job_config, tokenizer) -> HyenaArgs:
    """The vocabulary comes from the tokenizer; the filters must cover the training sequence length."""
    max_seq_len = max(args.max_seq_len, job_config.training.seq_len)
    return dataclasses.replace(args, vocab_size=tokenizer.vocab_size, max_seq_len=max_seq_len)


def _shard_channels(module: nn.Module, names: tuple[str, ...], tp_mesh: DeviceMesh) -> None:
    """Shards per-channel parameters on dim 0, matching the channel shard of the column-parallel projections."""
    for name in names:
        param = getattr(module, name)
        module.register_parameter(name, nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)])))


def apply_tp(model: HyenaLM, tp_mesh: DeviceMesh, loss_parallel: bool = False) -> None:
    """Megatron-style TP with sequence-parallel norms; each rank owns whole channels of every mixer.

    in_proj is column-parallel over channels (each with its value and gates), the short and long convolutions are
    per channel so they run on the local shard without communication, and out_proj is row-parallel. The filter
    MLP is replicated (as DTensors, so that gradient clipping and FSDP see one kind of parameter); its last
    projection is column-parallel over the same channels. The logits are replicated (`loss_parallel` is not used).
    """
    tp = tp_mesh.size()
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        plan = {
            "mixer_norm": SequenceParallel(),
            "mixer": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mixer.in_proj": ColwiseParallel(),
            "mixer.filter.mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "mixer.filter.proj": ColwiseParallel(),
            "mixer.out_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp_norm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, plan)
        distribute_module(block.mixer.filter.mlp, tp_mesh)  # replicated: every parameter is a DTensor under TP
        _shard_channels(block.mixer, ("short_weight", "short_bias"), tp_mesh)
        _shard_channels(block.mixer.filter, ("decay", "bias"), tp_mesh)
    logger.info(f"applied tensor + sequence parallel to hyena (degree {tp})")


def check_hyena_layout(args: HyenaArgs, parallel_dims, job_config) -> None:
    """The layouts Hyena's parallelization can shard (a run rule, checked before anything is built)."""
    if parallel_dims.cp_enabled or parallel_dims.pp_enabled:
        raise ValueError("hyena supports data and tensor parallelism; set context and pipeline degrees to 1")
    if args.dim % parallel_dims.tp:
        raise ValueError(f"tensor_parallel_degree {parallel_dims.tp} must divide the model dim {args.dim}")


def parallelize_hyena(model: HyenaLM, parallel_dims, job_config) -> HyenaLM:
    """The engine's parallelization (titan.distributed.parallelize) with Hyena's TP plan."""
    return parallelize(model, parallel_dims, job_config, apply_tp)


hyena_spec = register_model_spec(
    ModelSpec(
        name="hyena",
        flavors=hyena_flavors,
        build_model=HyenaLM,
        parallelize=parallelize_hyena,
        build_dataloader=build_text_dataloader,
        build_tokenizer=build_tokenizer,
        update_model_args=update_model_args,
        flops_per_token=flops_per_token,
        check_layout=check_hyena_layout,
    )
)
