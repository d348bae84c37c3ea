"""The dry-run half of the estimator: the real model, split into pipeline stages and sharded by the training code
on a fake process group, one representative rank per pipeline position.

What this reads back (local shapes, which blocks are checkpointed, FSDP units) comes from the parallelized
modules, so a change to the parallelize plan shows up in the estimate without touching the estimator.
"""

from __future__ import annotations

import copy
import functools
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

from titan.config.dtypes import TORCH_DTYPES
from titan.distributed import ParallelDims
from titan.distributed.pipeline import schedule_of, stage_ids_for_rank, stage_ranges
from titan.models.common.moe import MoE
from titan.quantization.float8 import Float8AllGatherWeight


@dataclass
class PartInfo:
    """One pipeline stage as held by one rank, after TP/AC/FSDP."""

    stage: int
    layers: list[int]
    has_embedding: bool
    has_output: bool
    """Whether the stage makes the logits: with its own output layer, or with the tied embedding matrix."""
    local_params: int
    """Elements this rank stores (real local shapes of the sharded parameters)."""
    local_param_bytes: int
    """Bytes of those elements in the parameters' own dtype (the fp32 master copy)."""
    unsharded_params: int
    """Elements after the FSDP all-gather (TP-local): what forward and backward compute with."""
    block_params: list[int]
    """Unsharded (TP-local) elements of each block: one FSDP unit each (without its MoE layer's own units: the
    routed experts under expert parallel, the whole layer under tensor parallel)."""
    block_moe_params: list[int]
    """Under tensor parallel, each block's MoE layer (router, shared experts, and the routed experts without expert
    parallel) as gathered, whole: its own FSDP unit over the data-parallel and TP ranks (dp_shard_cp_tp), since
    each TP rank routes its own sequence shard; 0 for a dense block or without TP."""
    block_expert_params: list[int]
    """Under expert parallel, each block's routed experts as this rank computes with them (its num_experts / ep
    experts, whole): their own FSDP unit over dp_shard_mod_ep, or resident when no rank is left for it; 0 for a
    dense block or without expert parallel."""
    local_expert_params: int
    """Of local_params, those of the routed experts' own units (expert parallel)."""
    local_moe_params: int
    """Of local_params, those of the MoE layers' own units (tensor parallel)."""
    block_active_params: list[int]
    """Elements of each block one token computes with (all of them less the routed experts it is not sent to,
    E - k of E): what its FLOPs count."""
    block_moe: list[bool]
    """Whether each block's feed-forward is a mixture of experts."""
    root_params: int
    """Unsharded (TP-local) elements of the root FSDP unit (embedding, final norm, output), 0 on middle stages."""
    block_float8_params: list[int]
    """Of each block's unsharded elements, those FSDP all-gathers in float8 (one byte each)."""
    block_float8_weights: list[int]
    """Weights of each block all-gathered in float8: each gather of one first all-reduces its amax."""
    full_ac_blocks: int
    op_ac_blocks: int
    distinct_params: float
    """Sum over every rank of the stage of local elements / replicas: equals the stage's parameter count."""


@dataclass
class RankInfo:
    rank: int
    pp_rank: int
    coordinate: dict[str, int]
    parts: list[PartInfo] = field(default_factory=list)


@contextmanager
def fake_process_group(rank: int, world_size: int):
    """A fake backend: collectives return at once, so any world size fits in one process."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tp_sharded(p: DTensor) -> bool:
    names = p.device_mesh.mesh_dim_names or ()
    return "tp" in names and not p.placements[names.index("tp")].is_replicate()


def _distinct_elements(p: torch.Tensor) -> float:
    """Local elements summed over all coordinates of the parameter's mesh, each divided by its replica count."""
    if not isinstance(p, DTensor):
        return float(p.numel())
    return _distinct_for_layout(tuple(p.shape), tuple(p.device_mesh.shape), tuple(p.placements))


@functools.cache
def _distinct_for_layout(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple) -> float:
    # Blocks repeat the same few shapes and placements: each layout is enumerated once per process.
    replicas = 1
    for size, placement in zip(mesh_shape, placements):
        replicas *= size if isinstance(placement, Replicate) else 1
    total = 0
    for coord in itertools.product(*(range(s) for s in mesh_shape)):
        shape, _ = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coord), placements,
                                                          skip_offset=True)
        total += torch.Size(shape).numel()
    return total / replicas


def _unsharded(p: torch.Tensor, tp: int) -> int:
    return p.numel() // tp if isinstance(p, DTensor) and _tp_sharded(p) else p.numel()


def _local(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def _gathers_in_float8(p: torch.Tensor) -> bool:
    """float8.enable_fsdp_float8_all_gather wrapped it (the FSDP shard, under TP too, is the local tensor)."""
    return isinstance(p._local_tensor if isinstance(p, DTensor) else p, Float8AllGatherWeight)


def _moe(block: nn.Module) -> MoE | None:
    return next((m for m in block.modules() if isinstance(m, MoE)), None)


def _routed(block: nn.Module) -> list[torch.Tensor]:
    moe = _moe(block)
    return list(moe.experts.parameters()) if moe is not None else []


def _active(block: nn.Module) -> int:
    moe = _moe(block)
    total = sum(p.numel() for p in block.parameters())
    if moe is None:
        return total
    e, k = moe.args.num_experts, moe.args.top_k
    return total - sum(p.numel() for p in moe.experts.parameters()) // e * (e - k)


def _moe_unit(block: nn.Module, tp: int, ep: int) -> list[torch.Tensor]:
    """The MoE layer's parameters that its own FSDP unit holds under tensor parallel (all but expert-parallel
    experts, a unit of their own); none without TP. The TP plan leaves them whole on every TP rank."""
    moe = _moe(block)
    if moe is None or tp == 1:
        return []
    experts = {id(p) for p in moe.experts.parameters()} if ep > 1 else set()
    return [p for p in moe.parameters() if id(p) not in experts]


def _part_info(part: nn.Module, stage: int, tp: int, ep: int, ac_mode: str, ac_option: str) -> PartInfo:
    blocks = list(part.layers.values())
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = [p for p in part.parameters() if id(p) not in in_blocks]
    # Expert parallel makes the routed experts a unit of their own, gathered to the rank's experts only; tensor
    # parallel the rest of the MoE layer (see _moe_unit).
    apart = [{id(p) for p in _routed(b)} if ep > 1 else set() for b in blocks]
    moe_units = [_moe_unit(b, tp, ep) for b in blocks]
    in_moe_units = [{id(p) for p in u} for u in moe_units]
    moe_params = [sum(p.numel() for p in u) for u in moe_units]
    block_params = [sum(_unsharded(p, tp) for p in b.parameters() if id(p) not in a | m)
                    for b, a, m in zip(blocks, apart, in_moe_units)]
    experts = [sum(p.numel() // ep for p in _routed(b)) if ep > 1 else 0 for b in blocks]
    root_params = sum(_unsharded(p, tp) for p in root)
    # torch.compile wraps the (checkpointed) block; FSDP subclasses it in place.
    wrapped = sum(isinstance(getattr(b, "_orig_mod", b), CheckpointWrapper) for b in blocks)
    op = ac_mode == "selective" and ac_option == "op"
    params = list(part.parameters())
    return PartInfo(
        stage=stage,
        layers=[int(k) for k in part.layers.keys()],
        has_embedding=part.tok_embeddings is not None,
        # A tied model (Llama 3.2 1B/3B) has no output layer, yet its last stage (the one with the final norm)
        # still pays the vocabulary matmul and the logits' memory.
        has_output=part.output is not None or (getattr(part.args, "tie_embeddings", False) and part.norm is not None),
        local_params=sum(_local(p) for p in params),
        local_param_bytes=sum(_local(p) * p.element_size() for p in params),
        unsharded_params=sum(block_params) + root_params + sum(experts) + sum(moe_params),
        block_params=block_params,
        block_moe_params=moe_params,
        block_expert_params=experts,
        local_expert_params=sum(_local(p) for b, a in zip(blocks, apart) for p in b.parameters() if id(p) in a),
        local_moe_params=sum(_local(p) for u in moe_units for p in u),
        block_active_params=[_active(b) for b in blocks],
        block_moe=[_moe(b) is not None for b in blocks],
        root_params=root_params,
        block_float8_params=[sum(_unsharded(p, tp) for p in b.parameters() if _gathers_in_float8(p) and id(p) not in m)
                             for b, m in zip(blocks, in_moe_units)],
        block_float8_weights=[sum(map(_gathers_in_float8, b.parameters())) for b in blocks],
        full_ac_blocks=0 if op else wrapped,
        op_ac_blocks=wrapped if op else 0,
        distinct_params=sum(_distinct_elements(p) for p in params),
    )


def stage_model(model: nn.Module, stage: int, ranges: list[range]) -> nn.Module:
    """A copy of the (meta) model pruned to one stage, as pipeline.split_model makes it (parameter names stay those
    of the full model), but copying only the stage's blocks, which keeps a 405B dry run in seconds."""
    blocks = model.layers
    model.layers = nn.ModuleDict()
    try:
        part = copy.deepcopy(model)
    finally:
        model.layers = blocks
    part.layers = nn.ModuleDict({str(i): copy.deepcopy(blocks[str(i)]) for i in ranges[stage]})
    if stage != 0:
        part.tok_embeddings = None
    if stage != len(ranges) - 1:
        part.norm = None
        part.output = None
    return part


def representative_rank(parallel_dims: ParallelDims, pp_rank: int) -> int:
    """The first rank of the pipeline position (data, context and tensor coordinates 0): it holds the largest
    FSDP shards when a dimension does not divide evenly."""
    return pp_rank * (parallel_dims.world_size // parallel_dims.pp)


def dry_run_rank(spec, model: nn.Module, job_config, parallel_dims: ParallelDims, pp_rank: int) -> RankInfo:
    """Builds the meshes and this pipeline rank's stages of the meta `model` on a fake process group, with the
    training code's parallelize function, and reads back what the rank holds."""
    pcfg = job_config.parallelism
    ranges = stage_ranges(len(model.layers), parallel_dims, pcfg)
    rank = representative_rank(parallel_dims, pp_rank)
    # A fresh ParallelDims: build_mesh keeps the mesh, which belongs to this fake group only.
    dims = ParallelDims(parallel_dims.dp_replicate, parallel_dims.dp_shard, parallel_dims.cp, parallel_dims.tp,
                        parallel_dims.pp, parallel_dims.world_size, parallel_dims.ep)
    with fake_process_group(rank, parallel_dims.world_size):
        mesh = dims.build_mesh("cpu")
        coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate())) if mesh is not None else {}
        info = RankInfo(rank=rank, pp_rank=pp_rank, coordinate=coordinate)
        for stage in stage_ids_for_rank(pp_rank, parallel_dims.pp, schedule_of(parallel_dims, pcfg)):
            part = spec.parallelize(stage_model(model, stage, ranges), dims, job_config)
            ac = job_config.activation_checkpoint
            info.parts.append(_part_info(part, stage, dims.tp, dims.ep, ac.mode, ac.selective_ac_option))
    return info


@dataclass
class Layout:
    """The run's shape as the estimator needs it, resolved from the config and ParallelDims."""

    args: object
    dims: object
    local_batch: int
    seq_len: int
    accum: int
    microbatches: int
    microbatch_seqs: int
    schedule: str
    param_bytes: int
    reduce_bytes: int
    optimizer: str
    momentum: float
    loss_parallel: bool
    reshard_after_forward: bool
    compile: bool
    float8: bool

    @property
    def local_tokens(self) -> int:
        """Tokens one rank computes per microbatch (its context-parallel share of the sequences)."""
        return self.microbatch_seqs * self.seq_len // self.dims.cp


def make_layout(args, dims, job_config, global_batch: int) -> Layout:
    t, pcfg = job_config.training, job_config.parallelism
    microbatches = t.local_batch_size // pcfg.pipeline_parallel_microbatch_size if dims.pp_enabled else 1
    reshard = pcfg.fsdp_reshard_after_forward
    return Layout(
        args=args, dims=dims, local_batch=t.local_batch_size, seq_len=t.seq_len,
        accum=global_batch // (t.local_batch_size * dims.dp_degree), microbatches=microbatches,
        microbatch_seqs=t.local_batch_size // microbatches,
        schedule=schedule_of(dims, pcfg),
        param_bytes=TORCH_DTYPES[t.mixed_precision_param].itemsize,
        reduce_bytes=TORCH_DTYPES[t.mixed_precision_reduce].itemsize,
        optimizer=job_config.optimizer.name, momentum=job_config.optimizer.momentum,
        loss_parallel=pcfg.enable_loss_parallel, compile=job_config.compile.enable,
        # The rule of titan.distributed.data_parallel: PP keeps a stage gathered across its microbatches.
        reshard_after_forward=reshard == "always" or (reshard == "default" and not dims.pp_enabled),
        float8=job_config.float8.enable,
    )
