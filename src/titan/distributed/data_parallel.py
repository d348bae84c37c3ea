"""FSDP2 / HSDP over a model whose blocks live in `model.layers`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from titan.config.dtypes import TORCH_DTYPES
from titan.tools.logging import logger


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: bool = True,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Shards each block of `model.layers` as its own FSDP unit, then the root (embeddings, head); `ignored_params`
    stay as they are (e.g. experts sharded by expert parallel alone)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them gathered.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                ignored_params=ignored_params)
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP"
    logger.info(f"applied {kind} on mesh {dict(zip(dp_mesh.mesh_dim_names, dp_mesh.shape))} "
                f"(param {param_dtype}, reduce {reduce_dtype})")


def apply_data_parallel(model: nn.Module, parallel_dims, job_config,
                        ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Applies FSDP over dp_shard (x cp), or HSDP over dp_replicate x dp_shard; a no-op on one rank."""
    if not (parallel_dims.fsdp_enabled or parallel_dims.dp_replicate_enabled):
        return model
    if parallel_dims.dp_replicate_enabled and parallel_dims.fsdp_enabled:
        shard = "dp_shard_cp" if parallel_dims.dp_shard > 1 and parallel_dims.cp_enabled else (
            "dp_shard" if parallel_dims.dp_shard > 1 else "cp")
        mesh = parallel_dims.world_mesh[("dp_replicate", parallel_dims.mesh_dim_name(shard))]
    elif parallel_dims.fsdp_enabled:
        mesh = parallel_dims.submesh("dp_shard_cp")
    else:
        # Replicas only: sharding over them gives the same numerics as DDP with less memory.
        mesh = parallel_dims.submesh("dp_replicate")
    training = job_config.training
    apply_fsdp(
        model,
        mesh,
        param_dtype=TORCH_DTYPES[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPES[training.mixed_precision_reduce],
        reshard_after_forward=reshard_after_forward(parallel_dims, job_config),
        ignored_params=ignored_params,
    )
    return model


def reshard_after_forward(parallel_dims, job_config) -> bool:
    """parallelism.fsdp_reshard_after_forward; by default yes, except under pipeline parallel."""
    reshard = job_config.parallelism.fsdp_reshard_after_forward
    return reshard == "always" or (reshard == "default" and not parallel_dims.pp_enabled)
