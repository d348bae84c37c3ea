"""What the Trainer builds and checks before step 1: the run's checks, model args, batch layout, model parts.

The model parts are built on the meta device, split into pipeline stages, parallelized in the one fixed order
that titan.distributed.parallelize states, then materialized with `to_empty` and initialized. The run's rules are
all checked in `check_run`, before any of this.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from titan.components.checkpoint import CheckpointManager, complete_steps, load_full_model_state_dict
from titan.components.checkpoint.initial_load import initial_checkpoint, initial_state_dict, load_initial_checkpoint
from titan.components.metrics.throughput import cpu_has_bf16_units
from titan.config import JobConfig
from titan.distributed import ParallelDims
from titan.distributed.pipeline import (
    check_schedule_supported,
    microbatch_count,
    split_model,
    stage_ids_for_rank,
    stage_ranges,
    stages_per_rank,
)
from titan.distributed.runtime import device_type
from titan.estimate.fit import check_memory, checkpoint_bytes
from titan.hf import read_hf_config
from titan.models.common.moe import MoE
from titan.protocols.model import PipelineModel
from titan.protocols.model_spec import ModelSpec
from titan.tools.cli import UserError, check_writable
from titan.tools.fault import check_faults
from titan.tools.logging import logger

# Above this a full copy on one host is too costly; such runs use a seed checkpoint for layout-independent init.
FULL_INIT_MAX_PARAMS = 2_000_000_000


def check_dump_folder_writable(folder: str) -> None:
    """Fails before anything is written when the dump folder cannot be created or written."""
    check_writable(folder, "job.dump_folder", "pass --job.dump_folder with a writable path")


def check_outputs_are_ours(cfg: JobConfig) -> None:
    """A new run (nothing to resume) never writes into another run's outputs: with metrics.jsonl or tensorboard
    files already in job.dump_folder it stops in one line, unless job.overwrite, which removes them first. A run
    that resumes from its checkpoint keeps appending. Checked by the launching rank 0 (the one writing metrics)."""
    writes_metrics = cfg.metrics.enable_jsonl or cfg.metrics.enable_tensorboard
    if int(os.environ.get("RANK", "0")) != 0 or cfg.checkpoint.create_seed_checkpoint or not writes_metrics:
        return
    folder = Path(cfg.dump_folder)
    if cfg.checkpoint.enable and complete_steps(folder / cfg.checkpoint.folder):
        return
    metrics, tb = folder / "metrics.jsonl", folder / cfg.metrics.save_tb_folder
    found = [p for p in (metrics, tb) if (p.is_file() and p.stat().st_size) or (p.is_dir() and any(p.iterdir()))]
    if not found:
        return
    if cfg.job.overwrite:
        for path in found:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        logger.info(f"job.overwrite: removed the previous run's {', '.join(p.name for p in found)} from {folder}")
        return
    raise UserError(f"job.dump_folder {folder} holds another run's {' and '.join(p.name for p in found)} and no "
                    "checkpoint to resume from; pass --job.dump_folder with a new folder, or --job.overwrite to "
                    "replace that run's metrics")


@dataclass(frozen=True)
class BuildInputs:
    """What a caller other than `python -m titan.train` hands the Trainer beside its config (e.g. morphens, which
    trains nets it built itself, one per rank)."""

    model_spec: ModelSpec | None = None
    """The model family, else the one model.name (and model.spec) registers."""
    model_args: Any = None
    """The architecture, else the flavor's with the config's --model.<field> keys."""
    initial_state_dict: dict[str, torch.Tensor] | None = None
    """Starting weights (full, unsharded), else checkpoint.initial_load_path's or the model's own init."""
    solo: bool = False
    """Train on this process alone (world size 1, no collectives) inside a multi-rank job that has already joined
    its process group, e.g. one ensemble member per rank."""


@dataclass(frozen=True)
class RunLayout:
    """What the run rules settle: the meshes' degrees and the batch."""

    parallel_dims: ParallelDims
    global_batch_size: int
    grad_accum_steps: int


def check_run(cfg: JobConfig, world_size: int, inputs: BuildInputs, spec: ModelSpec) -> RunLayout:
    """Every rule that would stop the run, checked here, in this one phase, before any process group exists or
    anything is built, so that a bad config fails fast and alike on every rank (a key's own type and range are
    checked by its config section when the config is read):

    1. the fault-injection spec parses (titan.tools.fault);
    2. job.dump_folder is writable;
    3. the parallel degrees multiply to the world size (ParallelDims);
    4. the layout (check_layout): sequence, batch and pipeline splits, the model's args and its family's rules;
    5. features this machine or layout cannot run (check_supported);
    6. a solo trainer does not checkpoint;
    7. the estimated peak memory fits this machine (registered models).
    """
    check_faults()
    check_dump_folder_writable(cfg.dump_folder)
    pd = ParallelDims.from_config(cfg.parallelism, world_size)
    global_batch, accum = check_layout(cfg, pd, spec, stand_in_model_args(spec, cfg, inputs.model_args))
    check_supported(pd, cfg)
    if inputs.solo and cfg.checkpoint.enable:
        raise UserError("checkpoint.enable with a solo trainer: checkpoints synchronize all ranks; disable one")
    if inputs.model_spec is None and inputs.model_args is None:  # the estimator knows only registered models
        check_memory(cfg, world_size)
    if cfg.debug.detect_anomaly:
        logger.info("debug.detect_anomaly: autograd checks every backward op's output for NaN and keeps "
                    "forward tracebacks; every step runs slower")
    return RunLayout(pd, global_batch, accum)


def stand_in_model_args(spec: ModelSpec, cfg: JobConfig, model_args: Any = None) -> Any:
    """The run's model args before its tokenizer exists: the vocabulary of the Hugging Face folder the run loads,
    else of the flavor, stands in for the tokenizer's, which no layout rule depends on."""
    vocab = getattr(model_args or spec.flavors.get(cfg.model.flavor), "vocab_size", 0)
    if cfg.checkpoint.initial_load_in_hf and cfg.checkpoint.initial_load_path:
        vocab = read_hf_config(Path(cfg.checkpoint.initial_load_path)).get("vocab_size", vocab)
    return resolve_model_args(spec, cfg, model_args, SimpleNamespace(vocab_size=vocab))


def check_layout(cfg: JobConfig, pd: ParallelDims, spec: ModelSpec, args: Any) -> tuple[int, int]:
    """The rules a layout must meet, for a run and for the estimator alike; returns (global batch size, gradient
    accumulation steps)."""
    t, pcfg = cfg.training, cfg.parallelism
    if pd.cp_enabled and t.seq_len % (2 * pd.cp):
        raise UserError(f"training.seq_len {t.seq_len} must be divisible by 2 x context_parallel_degree "
                         f"({2 * pd.cp}) for load-balanced ring attention")
    if pd.tp_enabled and t.seq_len % (pd.cp * pd.tp):
        raise UserError(f"training.seq_len {t.seq_len} must be divisible by context_parallel_degree x "
                         f"tensor_parallel_degree = {pd.cp * pd.tp} (sequence sharding)")
    layout = batch_layout(t, pd.dp_degree)
    if pd.pp_enabled:
        microbatch_count(cfg)
        if not hasattr(args, "n_layers"):
            raise UserError(f"model {spec.name} cannot be pipelined; set parallelism.pipeline_parallel_degree 1")
        stage_ranges(args.n_layers, pd, pcfg)
    if spec.check_layout is not None:
        spec.check_layout(args, pd, cfg)
    return layout


def check_supported(pd: ParallelDims, cfg: JobConfig) -> None:
    """Features this machine, this torch or this kind of run cannot have."""
    if pd.pp_enabled:
        check_schedule_supported(cfg.parallelism.pipeline_parallel_schedule, torch.device(device_type()))
        if cfg.validation.enable and cfg.parallelism.pipeline_parallel_schedule in ("ZBVZeroBubble", "DualPipeV"):
            # torch 2.14's V-schedules fail forward-only: their schedule.eval asserts "can't steal_bwd_input".
            raise UserError(f"validation with pipeline_parallel_schedule {cfg.parallelism.pipeline_parallel_schedule}"
                            ": torch's V-shaped schedules cannot run forward-only; pass --validation.enable false "
                            "or choose another schedule (e.g. Interleaved1F1B)")
    if cfg.comm.mode == "fake":
        raise UserError("comm.mode = 'fake' is a dry run, not training: use python -m titan.estimate")
    if cfg.metrics.comm_stats and cfg.compile.enable:
        raise UserError("metrics.comm_stats counts collectives with a dispatch mode, which torch.compile cannot "
                         "trace: count them in an eager run (--compile.enable false)")
    if cfg.parallelism.enable_async_tensor_parallel:
        if device_type() != "cuda":
            raise UserError("parallelism.enable_async_tensor_parallel needs CUDA (symmetric memory); "
                             "on the CPU drop --parallelism.enable_async_tensor_parallel")
        if not pd.tp_enabled:
            raise UserError("parallelism.enable_async_tensor_parallel needs tensor_parallel_degree > 1")
        if not (cfg.compile.enable and "model" in cfg.compile.components):
            raise UserError("parallelism.enable_async_tensor_parallel is a compiler pass: add --compile.enable "
                             "with 'model' in compile.components")


def seed_everything(debug) -> None:
    torch.manual_seed(debug.seed)
    if debug.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False


def resolve_model_args(spec: ModelSpec, job_config: JobConfig, model_args: Any, tokenizer: Any) -> Any:
    """The flavor's args (or the Hugging Face folder's) with the config's `--model.<field>` keys (checked against
    the family's fields when the config was read), then the spec's own updates (e.g. vocab size)."""
    if model_args is None:
        flavor = job_config.model.flavor
        if flavor == "hf" and spec.args_from_folder is not None:
            model_args = spec.args_from_folder(job_config)
        elif flavor not in spec.flavors:
            raise UserError(f"model.flavor: unknown flavor {flavor!r} of {spec.name}; "
                             f"known: {', '.join(spec.flavors)}{', hf' if spec.args_from_folder else ''}")
        else:
            model_args = copy.deepcopy(spec.flavors[flavor])
        if job_config.model.args:
            try:
                model_args = dataclasses.replace(model_args, **job_config.model.args)
            except ValueError as e:
                raise UserError(f"model: {e}") from None
    if spec.update_model_args is not None:
        model_args = spec.update_model_args(model_args, job_config, tokenizer)
    return model_args


def batch_layout(training, dp: int) -> tuple[int, int]:
    """(global batch size, gradient accumulation steps) for `dp` data-parallel ranks."""
    global_batch = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * dp
    if global_batch % (training.local_batch_size * dp):
        raise UserError(
            f"training.global_batch_size {global_batch} is not a multiple of local_batch_size "
            f"{training.local_batch_size} x data-parallel degree {dp}; adjust one of them"
        )
    return global_batch, global_batch // (training.local_batch_size * dp)


@dataclass
class PipelinePlacement:
    """Which pipeline stages this rank holds."""

    num_stages: int
    stage_ids: list[int]

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids


def split_for_pipeline(model: nn.Module, spec_name: str, pd: ParallelDims,
                       pcfg) -> tuple[list[nn.Module], PipelinePlacement]:
    """This rank's stages of the (meta) model."""
    if not isinstance(model, PipelineModel):
        raise UserError(f"model {spec_name} cannot be pipelined (it names no pipeline_first_modules / "
                         "pipeline_last_modules); set parallelism.pipeline_parallel_degree 1")
    schedule = pcfg.pipeline_parallel_schedule
    placement = PipelinePlacement(pd.pp * stages_per_rank(schedule),
                                  stage_ids_for_rank(pd.world_mesh["pp"].get_local_rank(), pd.pp, schedule))
    ranges = stage_ranges(len(model.layers), pd, pcfg)
    logger.info(f"pipeline stages' layers: {[list(r) for r in ranges]}")
    return split_model(model, placement.stage_ids, ranges), placement


def full_initial_state_dict(spec: ModelSpec, model_args: Any, seed: int) -> dict[str, torch.Tensor]:
    """The weights a single process would initialize, built on this rank's CPU."""
    with torch.device("cpu"):
        full = spec.build_model(model_args)
    torch.manual_seed(seed)
    with torch.no_grad():
        full.init_weights(buffer_device=torch.device("cpu"))
    return full.state_dict()


@torch.no_grad()
def materialize(parts: list[nn.Module], device: torch.device, initial_state_dict: dict[str, torch.Tensor] | None,
                pipelined: bool, broadcast: bool, seed: int) -> None:
    """Allocates the parallelized parts on `device` and fills them: from the state dict (a pipeline stage takes
    its own keys; `broadcast`: rank 0's values go to every rank) or by the model's own init with `seed`."""
    for part in parts:
        part.to_empty(device=device)
        if initial_state_dict is not None:
            names = set(part.state_dict())
            own = {k: v for k, v in initial_state_dict.items() if k in names} if pipelined else initial_state_dict
            load_full_model_state_dict(part, own, broadcast_from_rank0=broadcast)
            # Non-persistent buffers (e.g. RoPE tables) are not in state dicts.
            part.init_buffers(device)
        else:
            torch.manual_seed(seed)
            part.init_weights(buffer_device=device)
        part.train()


def warn_if_bf16_is_slow(device: torch.device, cfg: JobConfig) -> None:
    """bf16 autocast on a CPU without bf16 units (no AVX512-BF16, no AMX) emulates its matmuls, many times slower
    than float32 there (benchmarks/RESULTS.md), so the default precision would make every run crawl."""
    if device.type == "cpu" and cfg.training.mixed_precision_param == "bfloat16" and not cpu_has_bf16_units():
        logger.warning("training.mixed_precision_param bfloat16 on a CPU without bf16 units (no AVX512-BF16 or "
                       "AMX): its matmuls run 10-50x slower than float32 here; pass "
                       "--training.mixed_precision_param float32")


@dataclass
class ModelParts:
    """This rank's materialized model parts (one, or its pipeline stages) and what the metrics need of them."""

    parts: list[nn.Module]
    placement: PipelinePlacement | None
    num_params: int
    flops_per_token: float
    num_experts: int
    """Experts of each MoE layer of the whole model, 0 without any (a pipeline stage of this rank may have none)."""


def build_model_parts(spec: ModelSpec, model_args: Any, cfg: JobConfig, pd: ParallelDims, device: torch.device,
                      rank: int, world_size: int, initial_state_dict: dict[str, torch.Tensor] | None) -> ModelParts:
    """Meta model -> this rank's pipeline stages -> parallelized -> materialized and initialized."""
    warn_if_bf16_is_slow(device, cfg)
    with torch.device("meta"):
        model = spec.build_model(model_args)
    num_experts = next((m.args.num_experts for m in model.modules() if isinstance(m, MoE)), 0)
    if pd.ep_enabled and not num_experts:
        raise UserError(f"parallelism.expert_parallel_degree {pd.ep} needs a model with experts; "
                        f"{spec.name}/{cfg.model.flavor} has none: set it to 1")
    num_params = sum(p.numel() for p in model.parameters())
    flops_per_token = (spec.flops_per_token(model, model_args, cfg.training.seq_len) if spec.flops_per_token
                       else 6.0 * num_params)
    logger.info(f"model {spec.name}/{cfg.model.flavor}: {num_params:,} parameters, "
                f"{flops_per_token / 1e6:.1f} MFLOP/token")
    pp = pd.pp_enabled
    full_init = (initial_state_dict is None and cfg.debug.full_init and world_size > 1
                 and num_params <= FULL_INIT_MAX_PARAMS)
    if full_init:
        # Pipeline stages hold different parameters, so each rank builds the weights itself (same seed).
        initial_state_dict = full_initial_state_dict(spec, model_args, cfg.debug.seed) if pp or rank == 0 else {}
    parts, placement = split_for_pipeline(model, spec.name, pd, cfg.parallelism) if pp else ([model], None)
    parts = [spec.parallelize(part, pd, cfg) for part in parts]
    materialize(parts, device, initial_state_dict, pipelined=pp, broadcast=full_init and not pp, seed=cfg.debug.seed)
    return ModelParts(parts, placement, num_params, flops_per_token, num_experts)


def build_initialized_parts(spec: ModelSpec, model_args: Any, cfg: JobConfig, pd: ParallelDims,
                            device: torch.device, rank: int, world_size: int,
                            given: dict[str, torch.Tensor] | None) -> ModelParts:
    """build_model_parts from the run's starting weights: those given, else checkpoint.initial_load_path's (a
    Hugging Face folder is read before the build, a DCP step folder is checked before it and loaded into the
    built, sharded parts, each rank reading only its shards), else the model's own init."""
    own_folder = Path(cfg.dump_folder) / cfg.checkpoint.folder
    dcp_folder = None
    if given is None:
        given = initial_state_dict(spec, cfg, model_args, own_folder)
        dcp_folder = initial_checkpoint(cfg, own_folder)
    built = build_model_parts(spec, model_args, cfg, pd, device, rank, world_size, given)
    if dcp_folder is not None:
        load_initial_checkpoint(built.parts, *dcp_folder)
    return built


def build_checkpointer(cfg: JobConfig, spec_name: str, model_args: Any, num_params: int) -> CheckpointManager:
    """The run's CheckpointManager; with checkpointing on, its folder is checked for room before step 1."""
    checkpointer = CheckpointManager(
        Path(cfg.dump_folder) / cfg.checkpoint.folder,
        cfg.checkpoint,
        {"model": spec_name, "flavor": cfg.model.flavor, "model_args": repr(model_args)},
    )
    if checkpointer.enabled:
        checkpointer.check_room(checkpoint_bytes(num_params, cfg.optimizer))
    return checkpointer
