"""TorchTitan v0.2.2's config files load unchanged: its spellings, its defaults, one warning per key without effect.

The TOML below is written here from the key names of TorchTitan v0.2.2's JobConfig
(torchtitan/config/job_config.py) and the values of its llama3 train_configs; it is not a copy of those files.
"""

import json
import math

import pytest

from tests.titan.conftest import read_metrics, run_train
from titan.config import ConfigError, parse_args, torchtitan
from titan.train import main

# Every Llama-relevant key of v0.2.2's JobConfig, at the values its llama3 files use (or its defaults).
TORCHTITAN_TOML = """
[job]
dump_folder = "{dump}"
description = "Llama 3 debug training"
print_config = false
[profiling]
enable_profiling = false
save_traces_folder = "profile_trace"
profile_freq = 10
profiler_active = 1
profiler_warmup = 3
enable_memory_snapshot = false
save_memory_snapshot_folder = "memory_snapshot"
[metrics]
log_freq = 1
disable_color_printing = false
enable_tensorboard = false
save_tb_folder = "tb_here"
save_for_all_ranks = false
enable_wandb = false
[model]
name = "llama3"
flavor = "debugmodel"
hf_assets_path = ""
converters = ["float8"]
print_after_conversion = false
[optimizer]
name = "AdamW"
lr = 8e-4
beta1 = 0.85
beta2 = 0.97
eps = 1e-8
weight_decay = 0.1
implementation = "foreach"
early_step_in_backward = false
[lr_scheduler]
warmup_steps = 2
total_steps = 20
decay_ratio = 0.8
decay_type = "linear"
min_lr_factor = 0.0
[training]
dataset = "wiki_offline"
local_batch_size = 2
global_batch_size = -1
seq_len = 64
max_norm = 1.0
steps = 3
enable_cpu_offload = false
dtype = "float32"
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "float32"
gc_freq = 50
gc_debug = false
[training.dataloader]
num_workers = 0
pin_memory = false
[parallelism]
data_parallel_replicate_degree = 1
data_parallel_shard_degree = -1
fsdp_reshard_after_forward = "default"
tensor_parallel_degree = 1
disable_loss_parallel = true
enable_async_tensor_parallel = false
pipeline_parallel_degree = 1
pipeline_parallel_first_stage_less_layers = 1
pipeline_parallel_last_stage_less_layers = 1
pipeline_parallel_schedule = "Interleaved1F1B"
pipeline_parallel_schedule_csv = ""
pipeline_parallel_microbatch_size = 1
context_parallel_degree = 1
context_parallel_load_balancer = "headtail"
context_parallel_rotate_method = "allgather"
expert_parallel_degree = 1
expert_tensor_parallel_degree = 1
[checkpoint]
enable = false
folder = "checkpoint"
interval = 10
initial_load_model_only = true
initial_load_in_hf = false
initial_load_in_hf_quantized = false
last_save_model_only = false
last_save_in_hf = false
export_dtype = "float32"
async_mode = "async_with_pinned_mem"
keep_latest_k = 10
load_step = -1
exclude_from_loading = []
enable_first_step_checkpoint = false
create_seed_checkpoint = false
load_only = false
[activation_checkpoint]
mode = "selective"
selective_ac_option = "2"
early_stop = false
memory_budget = 0.5
preserve_rng_state = true
determinism_check = "default"
debug = false
[compile]
enable = false
components = ["model", "loss"]
backend = "inductor"
[quantize.linear.float8]
enable_fsdp_float8_all_gather = false
precompute_float8_dynamic_scale_for_fsdp = false
recipe_name = "rowwise"
filter_fqns = ["output", "feed_forward.w2"]
emulate = false
[comm]
init_timeout_seconds = 300
train_timeout_seconds = 100
trace_buf_size = 20000
save_traces_folder = "comm_traces"
save_traces_file_prefix = "rank_"
mode = "default"
[memory_estimation]
enable = false
[validation]
enable = false
dataset = "c4_validation"
local_batch_size = 8
seq_len = 2048
freq = 5
steps = 10
[debug]
seed = 42
deterministic = false
deterministic_warn_only = false
"""


def write(tmp_path, text=TORCHTITAN_TOML):
    path = tmp_path / "torchtitan.toml"
    path.write_text(text.replace("{dump}", str(tmp_path / "run")))
    return path


def test_every_llama_key_of_torchtitan_loads_with_its_meaning(tmp_path, capsys):
    cfg = parse_args(["--config", str(write(tmp_path))])
    assert capsys.readouterr().err == ""  # every value is TorchTitan's default or one we honour
    assert (cfg.model.flavor, cfg.metrics.save_tb_folder, cfg.lr_scheduler.total_steps) == ("debugmodel", "tb_here", 20)
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2) == (0.85, 0.97)
    assert cfg.parallelism.enable_loss_parallel is False
    assert cfg.checkpoint.async_mode == "async"
    assert cfg.float8.enable and cfg.float8.recipe == "rowwise"
    assert cfg.float8.filter_fqns == ["output", "feed_forward.w2"]
    assert cfg.debug.seed == 42 and cfg.training.seq_len == 64


def test_keys_their_files_leave_unset_have_torchtitan_defaults():
    cfg = parse_args([])
    # TorchTitan v0.2.2's JobConfig defaults, for the keys none of its four llama3 files sets.
    assert (cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor, cfg.lr_scheduler.decay_ratio) == (
        "linear", 0.0, -1.0)
    assert (cfg.optimizer.implementation, cfg.optimizer.weight_decay) == ("fused", 0.1)
    assert (cfg.optimizer.beta1, cfg.optimizer.beta2) == (0.9, 0.95)
    assert (cfg.checkpoint.keep_latest_k, cfg.checkpoint.load_step, cfg.checkpoint.exclude_from_loading) == (
        10, -1, [])
    assert (cfg.training.global_batch_size, cfg.training.mixed_precision_param,
            cfg.training.mixed_precision_reduce) == (-1, "bfloat16", "float32")
    assert cfg.compile.components == ["model", "loss"] and cfg.compile.backend == "inductor"
    assert (cfg.comm.init_timeout_seconds, cfg.comm.train_timeout_seconds, cfg.comm.trace_buf_size) == (
        300, 100, 20000)
    assert (cfg.parallelism.pipeline_parallel_schedule, cfg.parallelism.pipeline_parallel_microbatch_size,
            cfg.parallelism.fsdp_reshard_after_forward) == ("1F1B", 1, "default")
    assert cfg.float8.enable_fsdp_float8_all_gather is False and cfg.metrics.enable_wandb is False


def test_their_command_line_spellings():
    cfg = parse_args(["--comm.mode", "fake_backend", "--parallelism.disable_loss_parallel",
                      "--optimizer.beta2", "0.99", "--model.converters", "float8",
                      "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
                      "--model.tokenizer_path", "/x"])
    assert cfg.comm.mode == "fake" and cfg.parallelism.enable_loss_parallel is False
    assert cfg.optimizer.beta2 == 0.99 and cfg.float8.enable and cfg.float8.enable_fsdp_float8_all_gather
    assert cfg.model.hf_assets_path == "/x"
    assert parse_args(["--optimizer.betas", "0.8,0.99"]).optimizer.beta1 == 0.8  # our spelling still works


def test_a_key_without_effect_warns_once_when_it_asks_for_something(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torchtitan, "_WARNED", set())
    text = TORCHTITAN_TOML.replace("gc_freq = 50", "gc_freq = 7").replace(
        "precompute_float8_dynamic_scale_for_fsdp = false", "precompute_float8_dynamic_scale_for_fsdp = true")
    for _ in range(2):  # an entry point that parses twice still warns once
        parse_args(["--config", str(write(tmp_path, text))])
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("warning: training.gc_freq = 7 has no effect here")
    assert "quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp" in lines[1]


@pytest.mark.parametrize("override, key", [
    (["--training.dtype", "bfloat16"], "training.dtype"),
    (["--parallelism.expert_tensor_parallel_degree", "2"], "parallelism.expert_tensor_parallel_degree"),
    (["--model.converters", "mx"], "model.converters"),
    (["--checkpoint.initial_load_model_only", "false"], "checkpoint.initial_load_model_only"),
])
def test_what_would_compute_otherwise_is_refused_in_one_line(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        parse_args(override)
    assert "\n" not in str(e.value)


def test_a_torchtitan_debug_config_trains_three_steps_with_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    path = write(tmp_path, TORCHTITAN_TOML.replace("enable_wandb = false", "enable_wandb = true").replace(
        "enable_tensorboard = false", "enable_tensorboard = true"))
    # float8 is emulated on a CPU, 6-7x slower: its conversion is covered by the loading test above.
    proc = run_train(["--config", str(path), "--metrics.cpu_peak_tflops", "1", "--float8.enable", "false"])
    assert "warning" not in proc.stderr
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    # TorchTitan's warmup: step s (from 0) of w warmup steps runs at lr x (s + 1) / (w + 1).
    assert records[0]["lr"] == pytest.approx(8e-4 * 2 / 3)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert list((tmp_path / "run" / "tb_here").glob("events.out.tfevents.*"))
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    logged = run_file.read_bytes()
    assert all(json.dumps(r["loss"]).encode() in logged for r in records)


def test_torchtitan_datasets_fail_in_one_line_naming_the_override(tmp_path, capsys):
    code = main(["--training.dataset", "c4_test", "--job.dump_folder", str(tmp_path / "run"),
                 "--metrics.cpu_peak_tflops", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err
    assert err.startswith("error: training.dataset 'c4_test'") and "--training.dataset wiki_offline" in err
