"""Pipeline parallel: split a model into stages, place them on ranks, and drive them with a schedule.

A model takes part by holding its blocks in `model.layers` (a ModuleDict) and naming the modules only the
first and last stages keep in `pipeline_first_modules` / `pipeline_last_modules`; its forward must skip
parts that are None (a middle stage maps hidden states to hidden states).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from titan.compat import torch_at_least
from titan.tools.cli import UserError
from titan.tools.logging import logger

V_SCHEDULES = {"ZBVZeroBubble", "DualPipeV"}
SINGLE_STAGE_SCHEDULES = {"GPipe", "1F1B"}


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def stage_layer_ranges(n_layers: int, num_stages: int, layers_per_stage: int = 0,
                       split_points: list[int] | None = None) -> list[range]:
    """Consecutive layer ranges, one per stage.

    Default: as even as possible, with the remainder going to the middle stages so that the first and last
    stages, which also hold the embedding and the output layer, take fewer.
    """
    if split_points:
        starts = [0, *split_points]
        if sorted(set(starts)) != starts or starts[-1] >= n_layers or len(starts) != num_stages:
            raise UserError(
                f"pipeline_parallel_split_points {split_points} must be {num_stages - 1} increasing layer indices "
                f"in 1..{n_layers - 1} for {num_stages} stages"
            )
        ends = [*split_points, n_layers]
        return [range(a, b) for a, b in zip(starts, ends)]
    if layers_per_stage:
        if layers_per_stage * num_stages < n_layers or layers_per_stage * (num_stages - 1) >= n_layers:
            raise UserError(
                f"pipeline_parallel_layers_per_stage {layers_per_stage} x {num_stages} stages does not fit "
                f"{n_layers} layers; every stage needs at least one layer"
            )
        sizes = [layers_per_stage] * num_stages
        sizes[-1] -= layers_per_stage * num_stages - n_layers
    else:
        if n_layers < num_stages:
            raise UserError(f"{n_layers} layers cannot fill {num_stages} pipeline stages; lower the pipeline "
                             "degree or use a schedule with one stage per rank")
        base, extra = divmod(n_layers, num_stages)
        sizes = [base] * num_stages
        middle_first = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), s))
        for s in middle_first[:extra]:
            sizes[s] += 1
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_ids_for_rank(pp_rank: int, pp_degree: int, schedule: str) -> list[int]:
    """Loop layout (stage s on rank s % pp) or, for V schedules, rank r holding stages r and 2pp-1-r."""
    n = stages_per_rank(schedule)
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    return [pp_rank + i * pp_degree for i in range(n)]


def split_model(model: nn.Module, stage_ids: list[int], ranges: list[range]) -> list[nn.Module]:
    """One pruned deep copy of the (meta) model per stage; parameter names stay those of the full model."""
    first, last = model.pipeline_first_modules, model.pipeline_last_modules
    num_stages = len(ranges)
    parts = []
    for stage in stage_ids:
        part = copy.deepcopy(model)
        keep = {str(i) for i in ranges[stage]}
        for name in list(part.layers.keys()):
            if name not in keep:
                del part.layers[name]
        if stage != 0:
            for name in first:
                setattr(part, name, None)
        if stage != num_stages - 1:
            for name in last:
                setattr(part, name, None)
        parts.append(part)
    return parts


def stage_ranges(n_layers: int, parallel_dims, pcfg) -> list[range]:
    """The trainer's stage split: pp x stages-per-rank stages, evenly or as layers_per_stage / split points say."""
    if not parallel_dims.pp_enabled:
        return [range(n_layers)]
    split_points = [int(name.split(".")[1]) for name in pcfg.pipeline_parallel_split_points]
    num_stages = parallel_dims.pp * stages_per_rank(schedule_of(parallel_dims, pcfg))
    return stage_layer_ranges(n_layers, num_stages, pcfg.pipeline_parallel_layers_per_stage, split_points)


def schedule_of(parallel_dims, pcfg) -> str:
    return pcfg.pipeline_parallel_schedule if parallel_dims.pp_enabled else "1F1B"


def microbatch_count(job_config) -> int:
    pcfg = job_config.parallelism
    local_batch = job_config.training.local_batch_size
    if local_batch % pcfg.pipeline_parallel_microbatch_size:
        raise UserError(f"training.local_batch_size {local_batch} is not a multiple of "
                         f"parallelism.pipeline_parallel_microbatch_size {pcfg.pipeline_parallel_microbatch_size}")
    return local_batch // pcfg.pipeline_parallel_microbatch_size


def check_schedule_supported(schedule: str, device: torch.device) -> None:
    """Refuses, in one line, a schedule that the running torch cannot run on this device's backend."""
    if schedule == "ZBVZeroBubble" and device.type == "cpu" and not torch_at_least("2.12"):
        # Seen with torch 2.11: its first send fails with gloo's "Pair is not connected"; 2.14.1 runs it exactly.
        raise ValueError(f"parallelism.pipeline_parallel_schedule ZBVZeroBubble needs torch >= 2.12 on gloo "
                         f"(this is {torch.__version__}); use Interleaved1F1B or a newer torch")


def build_schedule(parts: list[nn.Module], stage_ids: list[int], num_stages: int, parallel_dims, job_config,
                   device: torch.device, loss_fn: Callable):
    """PipelineStages for this rank's parts and the configured schedule over them."""
    # Imported here: torch.distributed.pipelining imports torch._dynamo, over a second of every run's start-up.
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    pcfg = job_config.parallelism
    n_microbatches = microbatch_count(job_config)
    pp_group = parallel_dims.world_mesh["pp"].get_group()
    stages = [PipelineStage(part, stage, num_stages, device, group=pp_group) for part, stage in zip(parts, stage_ids)]
    schedule_cls = get_schedule_class(pcfg.pipeline_parallel_schedule)
    # The loss function divides by the microbatch count itself: the schedule's own gradient scaling would
    # also shrink gradients accumulated by earlier steps of gradient accumulation.
    try:
        if issubclass(schedule_cls, PipelineScheduleMulti):
            schedule = schedule_cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
        else:
            schedule = schedule_cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    except (ValueError, AssertionError) as e:
        raise UserError(f"pipeline schedule {pcfg.pipeline_parallel_schedule} with {n_microbatches} "
                         f"microbatches on {parallel_dims.pp} ranks: {e}") from None
    logger.info(f"pipeline: schedule {pcfg.pipeline_parallel_schedule}, {num_stages} stages, this rank holds "
                f"{stage_ids}, {n_microbatches} microbatches")
    return schedule
