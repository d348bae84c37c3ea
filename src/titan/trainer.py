"""A model-agnostic Trainer: the model and its data come from a ModelSpec; the engine does the rest."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan.components.checkpoint import CheckpointManager, full_model_state_dict, load_full_model_state_dict
from titan.components.metrics.logger import MetricsLogger
from titan.components.metrics.throughput import device_peak_tflops, peak_memory_gib
from titan.components.optimizer import build_lr_scheduler, build_optimizer
from titan.config import JobConfig, to_toml
from titan.config.dtypes import TORCH_DTYPES
from titan.distributed import ParallelDims, compile_loss
from titan.distributed.comm_stats import counted_step
from titan.distributed.pipeline import (
    build_schedule,
    microbatch_count,
    split_model,
    stage_ids_for_rank,
    stage_layer_ranges,
    stages_per_rank,
)
from titan.distributed.runtime import (
    device_type,
    init_distributed,
    set_default_threads,
    set_pg_timeouts,
    world_size_from_env,
)
from titan.distributed.utils import clip_grad_norm_
from titan.estimate.fit import check_memory, checkpoint_bytes
from titan.models import get_model_spec
from titan.protocols.model_spec import ModelSpec
from titan.tools.cli import Interrupted, UserError
from titan.tools.fault import check_faults, fault_point
from titan.tools.logging import init_logger, logger
from titan.tools.profiling import StepProfiler
from titan.tools.signals import StopSignals

# Above this a full copy on one host is too costly; such runs use a seed checkpoint for layout-independent init.
FULL_INIT_MAX_PARAMS = 2_000_000_000


class NonFiniteLossError(UserError):
    """Training produced a NaN/Inf loss or gradient norm."""


def check_dump_folder_writable(folder: str) -> None:
    """Fails before anything is written when the dump folder cannot be created or written."""
    path = Path(folder).absolute()
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise UserError(f"job.dump_folder {folder} is not writable ({probe} is not a writable folder); "
                         "pass --job.dump_folder with a writable path")


MODEL_OVERRIDES = ("n_layers", "dim", "n_heads", "n_kv_heads")


def resolve_model_args(spec: ModelSpec, job_config: JobConfig, model_args: Any, tokenizer: Any) -> Any:
    if model_args is None:
        flavor = job_config.model.flavor
        if flavor not in spec.flavors:
            raise UserError(f"model.flavor: unknown flavor {flavor!r} of {spec.name}; "
                             f"known: {', '.join(spec.flavors)}")
        model_args = copy.deepcopy(spec.flavors[flavor])
        overrides = {k: getattr(job_config.model, k) for k in MODEL_OVERRIDES if getattr(job_config.model, k)}
        unsupported = [k for k in overrides if not hasattr(model_args, k)]
        if unsupported:
            raise UserError(f"model.{unsupported[0]} cannot be overridden for {spec.name}; leave it at 0")
        if overrides:
            try:
                model_args = dataclasses.replace(model_args, **overrides)
            except ValueError as e:
                raise UserError(f"model overrides {overrides}: {e}") from None
    if spec.update_model_args is not None:
        model_args = spec.update_model_args(model_args, job_config, tokenizer)
    return model_args


def _replicated_value(t: torch.Tensor) -> torch.Tensor:
    """A scalar that loss parallel returns as a replicated DTensor, as a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class Trainer:
    """Builds on meta -> parallelize -> to_empty + init -> AdamW -> train loop with accumulation and clipping."""

    def __init__(self, job_config: JobConfig, model_spec: ModelSpec | None = None, model_args: Any = None,
                 initial_state_dict: dict[str, torch.Tensor] | None = None, solo: bool = False):
        """`solo`: train on this process alone (world size 1, no collectives) inside a multi-rank job that has
        already joined its process group, e.g. one ensemble member per rank."""
        init_logger()
        check_faults()
        self.config = job_config
        self.dump_folder = job_config.dump_folder
        check_dump_folder_writable(self.dump_folder)
        world_size = 1 if solo else world_size_from_env()
        # Layout errors come before process-group creation so a bad config fails fast and alike on every rank.
        self.parallel_dims = ParallelDims.from_config(job_config.parallelism, world_size)
        self._check_supported()
        if solo and job_config.checkpoint.enable:
            raise UserError("checkpoint.enable with solo=True: checkpoints synchronize all ranks; disable one")
        if model_spec is None and model_args is None and world_size == 1:
            # One process only: the estimator's dry run meshes a fake group, and DeviceMesh keeps state of it
            # that breaks a later real multi-rank mesh in the same process (DCP then saved one shard of two).
            check_memory(job_config, world_size)
        self.device = init_distributed(job_config.comm.init_timeout_seconds, job_config.comm.trace_buf_size,
                                       job_config.debug.distributed_debug, self.dump_folder)
        self.rank = dist.get_rank() if dist.is_initialized() and not solo else 0
        self.threads = set_default_threads(job_config.debug.threads)
        self.parallel_dims.build_mesh(self.device.type)
        if self.parallel_dims.world_size > 1:
            # Mesh groups are created with the backend's default timeout (30 min on gloo): use ours until step 1.
            set_pg_timeouts(job_config.comm.init_timeout_seconds, self.parallel_dims.world_mesh)
        self._seed(job_config.debug)

        self.spec = model_spec or get_model_spec(job_config.model.name, job_config.model.spec)
        self.loss_fn = compile_loss(self.spec.loss_fn, job_config.compile)
        self.tokenizer = self.spec.build_tokenizer(job_config) if self.spec.build_tokenizer else None
        self.model_args = resolve_model_args(self.spec, job_config, model_args, self.tokenizer)

        training = job_config.training
        dp = self.parallel_dims.dp_degree
        global_batch = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * dp
        if global_batch % (training.local_batch_size * dp):
            raise UserError(
                f"training.global_batch_size {global_batch} is not a multiple of local_batch_size "
                f"{training.local_batch_size} x data-parallel degree {dp}; adjust one of them"
            )
        self.global_batch_size = global_batch
        self.grad_accum_steps = global_batch // (training.local_batch_size * dp)

        with torch.device("meta"):
            model = self.spec.build_model(self.model_args)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = (
            self.spec.flops_per_token(model, self.model_args, training.seq_len)
            if self.spec.flops_per_token else 6.0 * self.num_params
        )
        logger.info(f"model {self.spec.name}/{job_config.model.flavor}: {self.num_params:,} parameters, "
                    f"{self.flops_per_token / 1e6:.1f} MFLOP/token")
        pp = self.parallel_dims.pp_enabled
        full_init = (initial_state_dict is None and job_config.debug.full_init and world_size > 1
                     and self.num_params <= FULL_INIT_MAX_PARAMS)
        if full_init:
            # Pipeline stages hold different parameters, so each rank builds the weights itself (same seed).
            initial_state_dict = self._full_initial_state_dict() if (pp or self.rank == 0) else {}
        parts = self._split_for_pipeline(model) if pp else [model]
        parts = [self.spec.parallelize(part, self.parallel_dims, job_config) for part in parts]
        for part in parts:
            part.to_empty(device=self.device)
            with torch.no_grad():
                if initial_state_dict is not None:
                    names = set(part.state_dict())
                    own = {k: v for k, v in initial_state_dict.items() if k in names} if pp else initial_state_dict
                    load_full_model_state_dict(part, own, broadcast_from_rank0=full_init and not pp)
                    # Non-persistent buffers (e.g. RoPE tables) are not in state dicts.
                    part.init_buffers(self.device)
                else:
                    torch.manual_seed(job_config.debug.seed)
                    part.init_weights(buffer_device=self.device)
            part.train()
        self.model_parts = parts
        self.sharded = self.parallel_dims.fsdp_enabled or self.parallel_dims.dp_replicate_enabled
        self.autocast_dtype = TORCH_DTYPES[training.mixed_precision_param]
        self.pp_schedule = None
        if pp:
            self.pp_loss_scale = microbatch_count(job_config) * self.grad_accum_steps
            self.pp_schedule = build_schedule(parts, self.stage_ids, self.num_stages, self.parallel_dims, job_config,
                                              self.device, self._pipeline_loss)

        self.optimizers = [build_optimizer(part, job_config.optimizer) for part in parts]
        self.lr_schedulers = [build_lr_scheduler(opt, job_config.lr_scheduler, training.steps)
                              for opt in self.optimizers]
        self.dp_rank = self.parallel_dims.dp_rank()
        self.dataloader = self.spec.build_dataloader(job_config, self.dp_rank, dp, self.tokenizer, "train")

        self.step = 0
        # Training seconds of this run over all its sessions: checkpoints carry it, so metrics' elapsed_s goes on.
        self.elapsed_s = 0.0
        self.consecutive_skips = 0
        self._data_iter = None
        self.history: list[dict[str, Any]] = []
        self.checkpointer = CheckpointManager(
            Path(self.dump_folder) / job_config.checkpoint.folder,
            job_config.checkpoint,
            {"model": self.spec.name, "flavor": job_config.model.flavor, "model_args": repr(self.model_args)},
        )
        if self.checkpointer.enabled:
            self.checkpointer.check_room(checkpoint_bytes(self.num_params, job_config.optimizer))
        state = None
        if not job_config.checkpoint.create_seed_checkpoint:
            state = self.checkpointer.load_latest(self.model_parts, self.optimizers, self.lr_schedulers,
                                                  self._train_state())
        if state is not None:
            self.step = state.get("step", 0)
            self.elapsed_s = state.get("elapsed_ms", 0) / 1000
            loader_keys = set(self.dataloader.state_dict())
            if "dataloader" not in job_config.checkpoint.exclude_from_loading and loader_keys <= set(state):
                self.dataloader.load_state_dict({k: state[k] for k in loader_keys})

        self.peak_tflops = device_peak_tflops(self.device, job_config.metrics.cpu_peak_tflops)
        self.metrics = MetricsLogger(self.dump_folder, job_config.metrics.enable_jsonl,
                                     job_config.metrics.enable_tensorboard, self.rank)

    @property
    def model(self) -> torch.nn.Module:
        """The model (the first of this rank's pipeline stages under pipeline parallel)."""
        return self.model_parts[0]

    def _split_for_pipeline(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        pcfg = self.config.parallelism
        pp_rank = self.parallel_dims.world_mesh["pp"].get_local_rank()
        self.num_stages = self.parallel_dims.pp * stages_per_rank(pcfg.pipeline_parallel_schedule)
        split_points = [int(name.split(".")[1]) for name in pcfg.pipeline_parallel_split_points]
        ranges = stage_layer_ranges(len(model.layers), self.num_stages, pcfg.pipeline_parallel_layers_per_stage,
                                    split_points)
        self.stage_ids = stage_ids_for_rank(pp_rank, self.parallel_dims.pp, pcfg.pipeline_parallel_schedule)
        self.pp_has_first = 0 in self.stage_ids
        self.pp_has_last = self.num_stages - 1 in self.stage_ids
        logger.info(f"pipeline stages' layers: {[list(r) for r in ranges]}")
        return split_model(model, self.stage_ids, ranges)

    def _pipeline_loss(self, pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Gradients sum over microbatches and accumulation steps: scale each loss to get their mean.
        return self.loss_fn(pred, labels) / self.pp_loss_scale

    def _full_initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a single process would initialize, built on this rank's CPU."""
        with torch.device("cpu"):
            full = self.spec.build_model(self.model_args)
        torch.manual_seed(self.config.debug.seed)
        with torch.no_grad():
            full.init_weights(buffer_device=torch.device("cpu"))
        return full.state_dict()

    def _check_supported(self) -> None:
        pd, cfg = self.parallel_dims, self.config
        if pd.cp_enabled and cfg.training.seq_len % (2 * pd.cp):
            raise UserError(f"training.seq_len {cfg.training.seq_len} must be divisible by 2 x "
                             f"context_parallel_degree ({2 * pd.cp}) for load-balanced ring attention")
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

    @staticmethod
    def _seed(debug) -> None:
        torch.manual_seed(debug.seed)
        if debug.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.backends.cudnn.benchmark = False

    def _autocast(self):
        # With FSDP the mixed-precision policy casts parameters; a single process uses autocast instead.
        if self.sharded or self.autocast_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _cp_context(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Context parallel: this rank computes on its (load-balanced) share of the sequence."""
        if not self.parallel_dims.cp_enabled:
            return nullcontext()
        from titan.distributed.context_parallel import sequence_sharded

        return sequence_sharded(self.parallel_dims.world_mesh["cp"], self.model_parts, inputs, labels)

    def _loss_context(self):
        """Loss parallel: cross-entropy on vocabulary-sharded logits, never gathering them."""
        if self.parallel_dims.tp_enabled and self.config.parallelism.enable_loss_parallel:
            return loss_parallel()
        return nullcontext()

    def _all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over the ranks that hold the values: all ranks, or under pipeline parallel the last stages."""
        if self.parallel_dims.world_size > 1:
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            holders = dist.get_world_size() // self.parallel_dims.pp
            values /= holders
        return values

    def _forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Loss of one micro-batch (zero on pipeline ranks without the last stage) and the model output."""
        if self.pp_schedule is not None:
            losses: list[torch.Tensor] = []
            with self._cp_context(inputs, labels), self._loss_context(), self._autocast():
                self.pp_schedule.step(*((inputs,) if self.pp_has_first else ()),
                                      target=labels if self.pp_has_last else None, losses=losses)
            if not self.pp_has_last:
                return torch.zeros((), device=self.device), None
            return torch.stack([_replicated_value(x.detach()) for x in losses]).mean() * self.pp_loss_scale, None
        with self._cp_context(inputs, labels), self._loss_context():
            with self._autocast():
                pred = self.model(inputs)
                loss = self.loss_fn(pred, labels)
                if fault_point("nan", self.step + 1):
                    loss = loss * float("nan")
            (loss / self.grad_accum_steps).backward()
        return _replicated_value(loss.detach()), pred.detach()

    def train_step(self, data_iter) -> dict[str, float]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns loss, grad_norm, extra metrics."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        extra_sums: dict[str, torch.Tensor] = {}
        tokens = 0
        for micro in range(self.grad_accum_steps):
            inputs, labels = next(data_iter)
            # Context parallel shards these in place: give it tensors of our own.
            inputs = inputs.to(self.device, non_blocking=True).clone()
            labels = labels.to(self.device, non_blocking=True).clone()
            tokens += labels.numel() // self.parallel_dims.cp
            for part in self.model_parts:
                if isinstance(part, FSDPModule):
                    part.set_requires_gradient_sync(micro == self.grad_accum_steps - 1)
            with torch.autograd.set_detect_anomaly(self.config.debug.detect_anomaly):
                loss, pred = self._forward_backward(inputs, labels)
            loss_sum += loss
            if self.spec.metrics_fn is not None and pred is not None:
                with torch.no_grad():
                    for k, v in self.spec.metrics_fn(pred, labels).items():
                        extra_sums[k] = extra_sums.get(k, 0) + _replicated_value(v.detach()).float()
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        pp_group = self.parallel_dims.world_mesh["pp"].get_group() if self.parallel_dims.pp_enabled else None
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm, pp_group)
        names = list(extra_sums)
        reduced = self._all_reduce_mean(
            torch.stack([loss_sum, *(extra_sums[k] for k in names)]) / self.grad_accum_steps
        ).tolist()
        loss_value, grad_norm_value = reduced[0], float(grad_norm)
        out = {"loss": loss_value, "grad_norm": grad_norm_value, "tokens": tokens,
               **{k: v for k, v in zip(names, reduced[1:])}}
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm_value)):
            self._on_nonfinite(loss_value, grad_norm_value)
            return out
        self.consecutive_skips = 0
        for opt, sched in zip(self.optimizers, self.lr_schedulers):
            opt.step()
            sched.step()
        return out

    def _on_nonfinite(self, loss: float, grad_norm: float) -> None:
        """Stops, or skips the update, as `training.on_nonfinite` says; never lets it reach a checkpoint."""
        step = self.step + 1
        training = self.config.training
        self.consecutive_skips += 1
        if training.on_nonfinite == "skip" and self.consecutive_skips <= training.max_consecutive_skips:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            logger.warning(f"step {step}: non-finite loss {loss} / grad norm {grad_norm}; update skipped "
                           f"({self.consecutive_skips} in a row, at most {training.max_consecutive_skips})")
            return
        raise NonFiniteLossError(
            f"non-finite loss {loss} / grad norm {grad_norm} at step {step}"
            f"{' after ' + str(self.consecutive_skips - 1) + ' skipped steps' if self.consecutive_skips > 1 else ''}"
            "; nothing of it was checkpointed. Lower optimizer.lr, raise lr_scheduler.warmup_steps, "
            "set training.max_norm, or resume from the last checkpoint"
        )

    def _eval_batch(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs, labels = inputs.clone(), labels.clone()
        if self.pp_schedule is not None:
            losses: list[torch.Tensor] = []
            with self._cp_context(inputs, labels), self._loss_context(), self._autocast():
                self.pp_schedule.eval(*((inputs,) if self.pp_has_first else ()),
                                      target=labels if self.pp_has_last else None, losses=losses)
            if not self.pp_has_last:
                return {"loss": torch.zeros((), device=self.device)}
            return {"loss": torch.stack([_replicated_value(x) for x in losses]).mean().float() * self.pp_loss_scale}
        with self._cp_context(inputs, labels), self._loss_context(), self._autocast():
            pred = self.model(inputs)
            values = {"loss": self.loss_fn(pred, labels).float()}
            if self.spec.metrics_fn is not None:
                values.update({k: v.float() for k, v in self.spec.metrics_fn(pred, labels).items()})
        return {k: _replicated_value(v) for k, v in values.items()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and spec metrics) over `validation.steps` batches of the validation split."""
        loader = self.spec.build_dataloader(self.config, self.dp_rank, self.parallel_dims.dp_degree,
                                            self.tokenizer, "validation")
        limit = self.config.validation.steps
        for part in self.model_parts:
            part.eval()
        sums: dict[str, torch.Tensor] = {}
        batches = 0
        for inputs, labels in loader:
            if 0 <= limit <= batches:
                break
            for k, v in self._eval_batch(inputs.to(self.device), labels.to(self.device)).items():
                sums[k] = sums.get(k, 0) + v
            batches += 1
        for part in self.model_parts:
            part.train()
        if batches == 0:
            raise UserError("the validation split yielded no batch; lower training.local_batch_size/seq_len")
        names = list(sums)
        reduced = self._all_reduce_mean(torch.stack([sums[k] for k in names]) / batches).tolist()
        return dict(zip(names, reduced))

    def save_checkpoint(self, last: bool = False) -> None:
        ckpt = self.config.checkpoint
        if last and ckpt.last_save_model_only:
            self.checkpointer.save_model_only(self.step, self.model_parts, TORCH_DTYPES[ckpt.export_dtype])
            return
        self.checkpointer.save(self.step, self.model_parts, self.optimizers, self.lr_schedulers, self._train_state())

    def _train_state(self) -> dict[str, int]:
        """Step, elapsed time and data position: plain integers, the same on every layout."""
        state = {"step": self.step, "elapsed_ms": round(self.elapsed_s * 1000), **self.dataloader.state_dict()}
        return {k: v for k, v in state.items() if isinstance(v, int)}

    def save_seed_checkpoint(self) -> None:
        """Step-0 weights only, so runs on any layout can start from identical weights."""
        if self.parallel_dims.world_size != 1:
            raise UserError("checkpoint.create_seed_checkpoint runs on one process; launch without torchrun")
        if not self.config.checkpoint.enable:
            raise UserError("checkpoint.create_seed_checkpoint needs --checkpoint.enable")
        self.checkpointer.save_model_only(0, self.model_parts, torch.float32)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for part in self.model_parts for k, v in full_model_state_dict(part).items()}

    def train(self) -> list[dict[str, Any]]:
        """Runs until `training.steps`; returns the logged records of this call."""
        cfg = self.config
        total = cfg.training.steps
        if self.step >= total:
            logger.info(f"nothing to do: already at step {self.step} of {total}")
            return self.history
        logger.info(
            f"training {self.spec.name} for steps {self.step + 1}..{total} on {self.parallel_dims.world_size} "
            f"rank(s) ({self.device.type}, {self.threads} threads), global batch {self.global_batch_size} "
            f"x seq {cfg.training.seq_len}, accumulation {self.grad_accum_steps}, dump folder {self.dump_folder}"
        )
        if self.rank == 0:  # a training run's own record; a trainer built to export or inspect writes none
            Path(self.dump_folder, "config.toml").write_text(to_toml(cfg))
        if cfg.debug.detect_anomaly:
            logger.info("debug.detect_anomaly: autograd checks every backward op's output for NaN and keeps "
                        "forward tracebacks; every step runs slower")
        with StepProfiler(cfg.profiling, self.dump_folder, self.rank, self.device, self.step) as profiler, \
                StopSignals() as signals:
            return self._train_steps(total, profiler, signals)

    def _train_steps(self, total: int, profiler: StepProfiler, signals: StopSignals) -> list[dict[str, Any]]:
        cfg = self.config
        if self._data_iter is None:
            self._data_iter = iter(self.dataloader)
        data_iter = self._data_iter
        window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
        start = window_start - self.elapsed_s
        # Only a trainer that owns the process group changes its timeouts (not one solo member of a larger job).
        owns_group = dist.is_initialized() and dist.get_world_size() == self.parallel_dims.world_size
        first_step = self.step + 1
        while self.step < total:
            fault_point("step", self.step + 1)
            out = (counted_step(lambda: self.train_step(data_iter), self.parallel_dims) if cfg.metrics.comm_stats
                   else self.train_step(data_iter))
            self.step += 1
            if owns_group and self.step == first_step:
                mesh = self.parallel_dims.world_mesh if self.parallel_dims.world_size > 1 else None
                set_pg_timeouts(cfg.comm.train_timeout_seconds, mesh)
            self.elapsed_s = time.perf_counter() - start
            window_tokens += out["tokens"]
            window_steps += 1
            validate = cfg.validation.enable and (self.step % cfg.validation.freq == 0 or self.step == total)
            log_now = self.step == 1 or self.step % cfg.metrics.log_freq == 0 or self.step == total or validate
            if log_now:
                now = time.perf_counter()
                seconds = max(now - window_start, 1e-9)
                tps = window_tokens / seconds
                tflops = self.flops_per_token * tps / 1e12
                record = {
                    "step": self.step,
                    "loss": out["loss"],
                    "grad_norm": out["grad_norm"],
                    "lr": self.lr_schedulers[0].get_last_lr()[0],
                    "tps": tps,
                    "tflops": tflops,
                    "mfu": 100.0 * tflops / self.peak_tflops if self.peak_tflops else None,
                    "memory_gib": peak_memory_gib(self.device),
                    "elapsed_s": self.elapsed_s,
                    **{k: v for k, v in out.items() if k not in ("loss", "grad_norm", "tokens")},
                }
                if validate:
                    record.update({f"val_{k}": v for k, v in self.evaluate().items()})
                eta = (total - self.step) * seconds / window_steps
                self.metrics.log(record, eta)
                self.history.append(record)
                window_start, window_tokens, window_steps = time.perf_counter(), 0, 0
            saved = self.checkpointer.should_save(self.step, total)
            if saved:
                self.save_checkpoint(last=self.step == total)
                window_start = time.perf_counter()
            if signum := signals.requested(self.device, owns_group and self.parallel_dims.world_size > 1):
                self._stop_on_signal(signum, saved)
            profiler.step(self.step)
        return self.history

    def _stop_on_signal(self, signum: int, saved: bool) -> None:
        """Ends the run after this step on every rank, with a checkpoint of it when checkpointing is on."""
        ckpt = self.checkpointer
        if ckpt.enabled and self.config.checkpoint.save_on_signal and not saved:
            self.save_checkpoint()
        ckpt.wait()
        kept = (f"checkpoint step-{self.step} saved; rerun the same command to resume" if ckpt.enabled
                and (saved or self.config.checkpoint.save_on_signal) else "no checkpoint written")
        raise Interrupted(signum, f"stopped after step {self.step}, {kept}")

    def close(self) -> None:
        """Waits for an async checkpoint in flight, then flushes and closes the metric sinks."""
        self.checkpointer.wait()
        self.metrics.close()
