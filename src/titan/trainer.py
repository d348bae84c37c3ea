"""A model-agnostic Trainer: the model and its data come from a ModelSpec; the engine does the rest."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from titan.builders import (
    BuildInputs,
    build_checkpointer,
    build_initialized_parts,
    check_run,
    resolve_model_args,
    seed_everything,
)
from titan.components.checkpoint import full_model_state_dict
from titan.components.forward import ForwardPath
from titan.components.metrics.logger import MetricsLogger
from titan.components.metrics.records import ThroughputWindow
from titan.components.metrics.throughput import device_peak_tflops
from titan.components.nonfinite import NonFiniteGuard
from titan.components.optimizer import build_lr_scheduler, build_optimizer
from titan.components.validate import evaluate
from titan.config import JobConfig, to_toml
from titan.config.dtypes import TORCH_DTYPES
from titan.distributed import compile_loss
from titan.distributed.comm_stats import counted_step
from titan.distributed.runtime import (
    init_distributed,
    set_default_threads,
    set_pg_timeouts,
    warn_if_cores_are_busy,
    world_size_from_env,
)
from titan.distributed.utils import clip_grad_norm_, mean_over_loss_holders, replicated_value
from titan.models import get_model_spec
from titan.models.common.moe_load import expert_load_values
from titan.quantization.float8 import precompute_float8_scales
from titan.tools.cli import Interrupted, UserError
from titan.tools.fault import fault_point
from titan.tools.logging import init_logger, logger
from titan.tools.profiling import StepProfiler
from titan.tools.signals import StopSignals


def agree_on_step(values: torch.Tensor, stop_signals: StopSignals, parallel_dims) -> torch.Tensor:
    """The step's values averaged over the ranks that hold them, then the stop-signal flags summed likewise: the
    flags ride on the same all-reduce, so agreeing costs no collective of its own. It stays on the device."""
    return mean_over_loss_holders(torch.cat([values, stop_signals.flags(values)]), parallel_dims)


class Trainer:
    """Builds on meta -> parallelize -> to_empty + init -> AdamW -> train loop with accumulation and clipping."""

    def __init__(self, job_config: JobConfig, inputs: BuildInputs | None = None):
        """`inputs`: what a caller other than `python -m titan.train` hands over beside the config (see
        BuildInputs); a plain run of a registered model needs none."""
        init_logger()
        inputs = inputs or BuildInputs()
        self.config = job_config
        self.dump_folder = job_config.dump_folder
        world_size = 1 if inputs.solo else world_size_from_env()
        self.spec = inputs.model_spec or get_model_spec(job_config.model.name, job_config.model.spec)
        layout = check_run(job_config, world_size, inputs, self.spec)
        self.parallel_dims = layout.parallel_dims
        self.global_batch_size, self.grad_accum_steps = layout.global_batch_size, layout.grad_accum_steps
        self.device = init_distributed(job_config.comm.init_timeout_seconds, job_config.comm.trace_buf_size,
                                       job_config.debug.distributed_debug, self.dump_folder)
        self.rank = dist.get_rank() if dist.is_initialized() and not inputs.solo else 0
        self.threads = set_default_threads(job_config.debug.threads)
        if self.rank == 0:
            warn_if_cores_are_busy(self.threads, self.device)
        self.parallel_dims.build_mesh(self.device.type)
        if self.parallel_dims.world_size > 1:
            # Mesh groups are created with the backend's default timeout (30 min on gloo): use ours until step 1.
            set_pg_timeouts(job_config.comm.init_timeout_seconds, self.parallel_dims.world_mesh)
        seed_everything(job_config.debug)

        self.tokenizer = self.spec.build_tokenizer(job_config) if self.spec.build_tokenizer else None
        self.model_args = resolve_model_args(self.spec, job_config, inputs.model_args, self.tokenizer)
        dp = self.parallel_dims.dp_degree
        self._build_model_parts(inputs.initial_state_dict, world_size)
        self.optimizers = [build_optimizer(part, job_config.optimizer) for part in self.model_parts]
        self.lr_schedulers = [build_lr_scheduler(opt, job_config.lr_scheduler, job_config.training.steps)
                              for opt in self.optimizers]
        self.dp_rank = self.parallel_dims.dp_rank()
        self.dataloader = self.spec.build_dataloader(job_config, self.dp_rank, dp, self.tokenizer, "train")

        self.step = 0
        # Training seconds of this run over all its sessions: checkpoints carry it, so metrics' elapsed_s goes on.
        self.elapsed_s = 0.0
        self.nonfinite = NonFiniteGuard(job_config.training, self.device)
        self.stop_signals = StopSignals()
        self._data_iter = None
        self.history: list[dict[str, Any]] = []
        self.checkpointer = build_checkpointer(job_config, self.spec.name, self.model_args, self.num_params)
        if not job_config.checkpoint.create_seed_checkpoint:
            # The latest complete checkpoint (or checkpoint.load_step), if the folder holds one.
            self.checkpointer.load_latest(self.model_parts, self.optimizers, self.lr_schedulers, self)
        self.peak_tflops = device_peak_tflops(self.device, TORCH_DTYPES[job_config.training.mixed_precision_param],
                                              job_config.metrics.cpu_peak_tflops)
        self.metrics = MetricsLogger.from_config(job_config, self.rank)
        if job_config.job.print_config:
            logger.info(f"config:\n{to_toml(job_config)}")

    def _build_model_parts(self, initial_state_dict: dict[str, torch.Tensor] | None, world_size: int) -> None:
        cfg = self.config
        built = build_initialized_parts(self.spec, self.model_args, cfg, self.parallel_dims, self.device, self.rank,
                                        world_size, initial_state_dict)
        self.model_parts = built.parts
        self.num_params, self.flops_per_token = built.num_params, built.flops_per_token
        # Every pipeline rank of a model with experts reports their load (a stage may hold dense blocks only).
        self.moe_pp_group = (self.parallel_dims.world_mesh["pp"].get_group()
                             if built.num_experts and self.parallel_dims.pp_enabled else None)
        self.num_experts = built.num_experts
        self.forward = ForwardPath(built.parts, built.placement, self.parallel_dims, cfg, self.device,
                                   compile_loss(self.spec.loss_fn, cfg.compile), self.spec.metrics_fn,
                                   self.grad_accum_steps, TORCH_DTYPES[cfg.training.mixed_precision_param])

    def state_dict(self) -> dict[str, int]:
        """The train state a checkpoint carries: step, elapsed time and data position, plain integers that are the
        same on every layout."""
        state = {"step": self.step, "elapsed_ms": round(self.elapsed_s * 1000), **self.dataloader.state_dict()}
        return {k: v for k, v in state.items() if isinstance(v, int)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores what `state_dict` saved (the data position unless checkpoint.exclude_from_loading names it)."""
        self.step = state.get("step", 0)
        self.elapsed_s = state.get("elapsed_ms", 0) / 1000
        loader_keys = set(self.dataloader.state_dict())
        if "dataloader" not in self.config.checkpoint.exclude_from_loading and loader_keys <= set(state):
            self.dataloader.load_state_dict({k: state[k] for k in loader_keys})

    @property
    def model(self) -> torch.nn.Module:
        """The model (the first of this rank's pipeline stages under pipeline parallel)."""
        return self.model_parts[0]

    def train_step(self, data_iter) -> dict[str, Any]:
        """One optimizer step over `grad_accum_steps` micro-batches, queued without waiting for the device.
        Returns `tokens` and the step's values on the device; `read_step` turns them into loss, grad_norm, extra
        metrics and the stop signal."""
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
                loss, pred = self.forward.forward_backward(inputs, labels, fault_point("nan", self.step + 1))
            loss_sum += loss
            if self.spec.metrics_fn is not None and pred is not None:
                with torch.no_grad():
                    for k, v in self.spec.metrics_fn(pred, labels).items():
                        extra_sums[k] = extra_sums.get(k, 0) + replicated_value(v.detach()).float()
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        pp_group = self.parallel_dims.world_mesh["pp"].get_group() if self.parallel_dims.pp_enabled else None
        grad_norm = clip_grad_norm_(params, self.config.training.max_norm, pp_group)
        names = list(extra_sums)
        values = torch.stack([loss_sum, *(extra_sums[k] for k in names)]) / self.grad_accum_steps
        reduced = agree_on_step(values, self.stop_signals, self.parallel_dims)
        found_inf = self.nonfinite.observe(self.step + 1, reduced[0], grad_norm)
        apply = self.nonfinite.mask_update(self.optimizers, found_inf)
        for opt, sched in zip(self.optimizers, self.lr_schedulers):
            if apply:
                opt.step()
            sched.step()
        if self.config.float8.enable_fsdp_float8_all_gather:
            for part in self.model_parts:
                precompute_float8_scales(part)
        # MoE: token counts summed over the ranks that see other tokens (each TP rank its sequence shard), biases moved.
        dp = self.parallel_dims.submesh("dp_cp_tp" if self.parallel_dims.tp_enabled else "dp_cp")
        moe_names, moe_values = expert_load_values(self.model_parts, dp.get_group() if dp is not None else None,
                                                   self.moe_pp_group, self.num_experts)
        device_values = torch.cat([moe_values.to(self.device), reduced.double(), grad_norm.reshape(1).double(),
                                   self.nonfinite.state.double()])
        return {"tokens": tokens, "names": names, "moe_names": moe_names, "device_values": device_values}

    def read_step(self, out: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The step's values on the host (its one device sync), the non-finite policy applied: (loss, grad_norm,
        extra metrics and tokens; the stop signal every rank agrees on, 0 for none)."""
        names, host = out["names"], out["device_values"].tolist()
        moe, host = dict(zip(out["moe_names"], host)), host[len(out["moe_names"]):]
        values, grad_norm = host[:len(names) + 1], host[-5]
        flags, state = host[len(names) + 1:-5], host[-4:]
        self.nonfinite.check(state, self.step, values[0], grad_norm)
        # What the step gave on the host already (tokens, metrics.comm_stats' bytes) passes through.
        given = {k: v for k, v in out.items() if k not in ("names", "moe_names", "device_values")}
        return ({"loss": values[0], "grad_norm": grad_norm, **given, **dict(zip(names, values[1:])), **moe},
                self.stop_signals.agreed(flags))

    def save_checkpoint(self, last: bool = False) -> None:
        ckpt = self.config.checkpoint
        if last and ckpt.last_save_model_only:
            self.checkpointer.save_model_only(self.step, self.model_parts, TORCH_DTYPES[ckpt.export_dtype])
            return
        self.checkpointer.save(self.step, self.model_parts, self.optimizers, self.lr_schedulers, self)

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
        with StepProfiler(cfg.profiling, self.dump_folder, self.rank, self.device, self.step) as profiler, \
                self.stop_signals:
            return self._train_steps(total, profiler)

    def _train_steps(self, total: int, profiler: StepProfiler) -> list[dict[str, Any]]:
        cfg = self.config
        if self._data_iter is None:
            self._data_iter = iter(self.dataloader)
        data_iter = self._data_iter
        window = ThroughputWindow(self.flops_per_token, self.peak_tflops, self.device)
        start = window.start - self.elapsed_s
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
            window.add_step(out["tokens"])
            validate = cfg.validation.enable and (self.step % cfg.validation.freq == 0 or self.step == total)
            log = self.step == 1 or self.step % cfg.metrics.log_freq == 0 or self.step == total or validate
            saved = self.checkpointer.should_save(self.step, total)
            # The host reads the step only where it must (the same steps on every rank), or where a single
            # process already knows of its own signal.
            signum = 0
            if log or saved or (self.stop_signals.signum and self.parallel_dims.world_size == 1):
                out, signum = self.read_step(out)
            self.elapsed_s = time.perf_counter() - start
            if log:
                record, eta = window.record(self.step, out, self.lr_schedulers[0].get_last_lr()[0], self.elapsed_s,
                                            total - self.step)
                if validate:
                    record.update({f"val_{k}": v for k, v in self.validate().items()})
                    window.restart()
                self.metrics.log(record, eta)
                self.history.append(record)
            if saved:
                self.save_checkpoint(last=self.step == total)
                window.start = time.perf_counter()
            if signum:
                self._stop_on_signal(signum, saved)
            profiler.step(self.step)
        return self.history

    def validate(self) -> dict[str, float]:
        """Loss (and the spec's metrics) over validation.steps batches of the validation split."""
        cfg = self.config
        loader = self.spec.build_dataloader(cfg, self.dp_rank, self.parallel_dims.dp_degree, self.tokenizer,
                                            "validation")
        return evaluate(self.forward, loader, cfg.validation.steps)

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
