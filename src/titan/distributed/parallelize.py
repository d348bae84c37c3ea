"""The one order in which titan parallelizes a model part (each pipeline stage alone, after the meta model is split
by titan.builders), stated here and nowhere else:

1. float8: eligible nn.Linear become Float8Linear (titan.quantization.float8), so TP and FSDP shard those;
2. tensor + sequence parallel: the family's plan, in which a mixture of experts runs on the rank's own sequence
   shard (then async TP, a compiler pass, when asked for);
3. activation checkpointing of each block;
4. torch.compile of each block;
5. float8 all-gather of the FSDP-sharded weights, when asked for;
6. expert parallel (models with experts): experts sharded over the ep mesh (which holds the cp and TP ranks), each
   MoE layer's experts their own FSDP units over the data-parallel ranks outside the expert group; under tensor
   parallel each MoE layer is an FSDP unit over the data-parallel and TP ranks, which sums its gradients over the TP
   ranks' tokens;
7. FSDP/HSDP (data parallel), outermost, so it shards what the steps above produced (and leaves the MoE to 6).

Context parallel is no module transform: the forward path (titan.components.forward) shards the sequence and the
model's `context_parallel_buffers` around each step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan.distributed.activation_checkpoint import apply_ac
from titan.distributed.compile import apply_compile
from titan.distributed.data_parallel import apply_data_parallel
from titan.distributed.expert_parallel import apply_moe_data_parallel
from titan.quantization.float8 import apply_float8, enable_float8_all_gather
from titan.tools.logging import logger


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


def parallelize(model: nn.Module, parallel_dims, job_config,
                apply_tp: Callable[[nn.Module, DeviceMesh, bool], None] | None) -> nn.Module:
    """Applies the steps above in place and returns the model; `apply_tp(model, tp_mesh, loss_parallel)` is the
    family's TP plan (None: the family has none, and its layout rules refuse TP)."""
    apply_float8(model, job_config.float8)
    if parallel_dims.tp_enabled and apply_tp is not None:
        tp_mesh = parallel_dims.world_mesh["tp"]
        apply_tp(model, tp_mesh, job_config.parallelism.enable_loss_parallel)
        if job_config.parallelism.enable_async_tensor_parallel:
            apply_async_tp(tp_mesh)
    apply_ac(model, job_config.activation_checkpoint)
    apply_compile(model, job_config.compile)
    if job_config.float8.enable_fsdp_float8_all_gather:
        apply_float8_all_gather(model, parallel_dims)
    experts_alone = apply_moe_data_parallel(model, parallel_dims, job_config)
    apply_data_parallel(model, parallel_dims, job_config, ignored_params=experts_alone)
    return model
