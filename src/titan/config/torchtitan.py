"""TorchTitan v0.2.2's key names, so that its TOML files and command lines load here unchanged.

Three kinds of keys: those we spell differently (renamed or with other value names) are translated; those
that change nothing here are accepted, with one warning line when the value asks for something we do not do;
those that would make a run compute something else than asked are refused in one line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# TorchTitan spelling -> ours (section.key).
RENAMED = {
    "parallelism.disable_loss_parallel": "parallelism.enable_loss_parallel",
    "model.tokenizer_path": "model.hf_assets_path",
    "quantize.linear.float8.enable_fsdp_float8_all_gather": "float8.enable_fsdp_float8_all_gather",
    "quantize.linear.float8.recipe_name": "float8.recipe",
    "quantize.linear.float8.filter_fqns": "float8.filter_fqns",
}
INVERTED = {"parallelism.disable_loss_parallel"}
VALUE_ALIASES = {
    "comm.mode": {"fake_backend": "fake"},
    "checkpoint.async_mode": {"async_with_pinned_mem": "async"},
}

# Keys with no effect here: (TorchTitan's default, what happens here instead). A value other than the default
# gets one warning line.
NO_EFFECT: dict[str, tuple[Any, str]] = {
    "job.save_config_file": (None, "the resolved config is always written to <dump_folder>/config.toml"),
    "job.custom_config_module": ("", "config sections are titan's own; a model from another package is named "
                                     "by model.spec"),
    "profiling.profiler_active": (1, "each profiled window records one step"),
    "profiling.profiler_warmup": (3, "the profiler's warm-up is fixed"),
    "metrics.disable_color_printing": (False, "the console log has no colors"),
    "metrics.save_for_all_ranks": (False, "only rank 0 writes metrics"),
    "model.print_after_conversion": (False, "float8 conversion logs one summary line"),
    "optimizer.early_step_in_backward": (False, "the optimizer steps after backward and clipping"),
    "training.enable_cpu_offload": (False, "parameters and optimizer states stay on the device"),
    "training.gc_freq": (50, "Python's garbage collector runs on its own schedule"),
    "training.gc_debug": (False, "Python's garbage collector runs on its own schedule"),
    "parallelism.module_fqns_per_model_part": (None, "pipeline stages are set by "
                                               "parallelism.pipeline_parallel_split_points"),
    "parallelism.pipeline_parallel_first_stage_less_layers": (1, "stages split evenly unless "
                                                              "pipeline_parallel_split_points says otherwise"),
    "parallelism.pipeline_parallel_last_stage_less_layers": (1, "stages split evenly unless "
                                                             "pipeline_parallel_split_points says otherwise"),
    "parallelism.pipeline_parallel_schedule_csv": ("", "schedules come from parallelism.pipeline_parallel_schedule"),
    "parallelism.pipeline_parallel_expert_parallel_overlap": (True, "Llama has no experts"),
    "parallelism.context_parallel_load_balancer": ("headtail", "context parallel always balances head and tail"),
    "parallelism.context_parallel_rotate_method": ("allgather", "ring attention rotates with torch's default"),
    "parallelism.expert_parallel_comm_backend": ("standard", "Llama has no experts"),
    "checkpoint.enable_ft_dataloader_checkpoints": (True, "there is no fault-tolerant replica group"),
    "checkpoint.last_save_in_hf": (False, "checkpoints are DCP; export with python -m titan.export --to-hf"),
    "checkpoint.enable_first_step_checkpoint": (False, "the first checkpoint is written at checkpoint.interval"),
    "checkpoint.load_only": (False, "checkpoints are saved as configured"),
    "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns": (["moe.router.gate"],
                                                                          "Llama has no router"),
    "activation_checkpoint.early_stop": (False, "recomputation runs whole"),
    "activation_checkpoint.memory_budget": (0.5, "only activation_checkpoint.mode none/full/selective exist"),
    "activation_checkpoint.visualize_memory_budget_pareto": (False, "there is no memory-budget mode"),
    "activation_checkpoint.preserve_rng_state": (True, "the RNG state is always preserved"),
    "activation_checkpoint.determinism_check": ("default", "torch's default check runs"),
    "activation_checkpoint.debug": (False, "no activation checkpoint debug output"),
    "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": (False, "with float8 all-gather the scales "
                                                                        "are always precomputed, once per step"),
    "quantize.linear.float8.emulate": (False, "float8 is emulated exactly where the device lacks float8 matmuls"),
    "comm.save_traces_folder": ("comm_traces", "flight-recorder dumps go to <dump_folder>/comm_traces"),
    "comm.save_traces_file_prefix": ("rank_", "flight-recorder dumps are named by rank"),
    "memory_estimation.enable": (False, "memory is estimated by python -m titan.estimate"),
    "memory_estimation.disable_fake_mode": (False, "memory is estimated by python -m titan.estimate"),
    "experimental.custom_import": ("", "a model from another package is named by model.spec"),
    "experimental.custom_args_module": ("", "config sections are titan's own"),
    "validation.dataset": ("c4_validation", "validation holds out training.validation_fraction of the corpus"),
    "validation.dataset_path": (None, "validation holds out training.validation_fraction of the corpus"),
    "validation.local_batch_size": (8, "validation batches are training.local_batch_size x training.seq_len"),
    "validation.seq_len": (2048, "validation batches are training.local_batch_size x training.seq_len"),
    "debug.deterministic_warn_only": (False, "debug.deterministic always warns only"),
    "debug.moe_force_load_balance": (False, "Llama has no experts"),
}
for _section in ("training", "validation"):
    for _key, _default in (("num_workers", 0), ("persistent_workers", False), ("pin_memory", False),
                           ("prefetch_factor", None)):
        NO_EFFECT[f"{_section}.dataloader.{_key}"] = (_default, "token blocks come from memory, without workers")
# Subsections that act only through something refused above (converters mx, fault_tolerance.enable): silent.
SILENT_PREFIXES = ("quantize.linear.mx.", "quantize.grouped_mm.", "fault_tolerance.")

# Keys whose non-default values would compute something else: (TorchTitan's default, why and what to do).
REFUSED: dict[str, tuple[Any, str]] = {
    "training.dtype": ("float32", "parameters train in fp32 with training.mixed_precision_param compute; "
                                  "set training.dtype = 'float32'"),
    "parallelism.expert_parallel_degree": (1, "Llama has no experts; set it to 1"),
    "parallelism.expert_tensor_parallel_degree": (1, "Llama has no experts; set it to 1"),
    "checkpoint.initial_load_model_only": (True, "only model weights load from checkpoint.initial_load_path"),
    "checkpoint.initial_load_in_hf_quantized": (False, "quantized Hugging Face weights are not read"),
    "fault_tolerance.enable": (False, "there is no TorchFT; restart failed workers with torchrun --max-restarts"),
}


def _same(value: Any, default: Any) -> bool:
    """A TOML value or a command-line string equal to TorchTitan's default."""
    if value == default:
        return True
    text = str(value).strip().lower()
    return text == str(default).lower() or (default in (None, "", []) and text in ("", "none", "[]"))


_WARNED: set[str] = set()


def _warn(message: str) -> None:
    """Once per process (an entry point may parse the same config twice), on rank 0."""
    if int(os.environ.get("RANK", "0")) == 0 and message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)


def translate(name: str, value: Any, from_cli: bool) -> list[tuple[str, Any]]:
    """TorchTitan's `section.key[.sub]` = value -> the (section.key, value) pairs to set here; [] for a key
    accepted without effect. Raises ValueError for a refused value; other names pass through unchanged."""
    if name in REFUSED:
        default, why = REFUSED[name]
        if not _same(value, default):
            raise ValueError(f"{name} = {value!r} is not supported: {why}")
        return []
    if name.startswith(SILENT_PREFIXES):
        return []
    if name in NO_EFFECT:
        default, what = NO_EFFECT[name]
        if not _same(value, default):
            _warn(f"{name} = {value!r} has no effect here: {what}")
        return []
    if name == "model.converters":
        return _converters(value, from_cli)
    if name == "optimizer.betas":
        betas = [float(b) for b in (value.strip("[]").split(",") if from_cli else value)]
        if len(betas) != 2:
            raise ValueError(f"optimizer.betas must be two numbers, got {value!r}")
        return [("optimizer.beta1", betas[0] if not from_cli else str(betas[0])),
                ("optimizer.beta2", betas[1] if not from_cli else str(betas[1]))]
    target = RENAMED.get(name, name)
    if name in INVERTED:
        value = (str(value).lower() in ("false", "0", "no", "off")) if from_cli else not value
        value = str(value) if from_cli else value
    aliases = VALUE_ALIASES.get(target, {})
    if isinstance(value, str) and value in aliases:
        value = aliases[value]
    return [(target, value)]


def _converters(value: Any, from_cli: bool) -> list[tuple[str, Any]]:
    names = [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()] if from_cli else value
    unknown = [n for n in names if n != "float8"]
    if unknown:
        raise ValueError(f"model.converters: {unknown[0]!r} is not available; the one converter here is 'float8'")
    return [("float8.enable", "true" if from_cli else True)] if names else []
