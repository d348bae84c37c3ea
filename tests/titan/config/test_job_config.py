"""Each section checks its own values: a value out of range is one line naming section.key and the value given;
the documented special values (-1 = the rest / latest / all) are accepted."""

import pytest

from titan.config import ConfigError, parse_args


@pytest.mark.parametrize("argv, message", [
    (["--job.name", "a/b"], "job.name must be a non-empty name without '/', got 'a/b'"),
    (["--training.steps", "0"], "training.steps must be > 0, got 0"),
    (["--training.local_batch_size", "-2"], "training.local_batch_size must be > 0, got -2"),
    (["--training.global_batch_size", "0"], "training.global_batch_size must be > 0 or -1, got 0"),
    (["--training.validation_fraction", "1"], "training.validation_fraction must be in [0, 1), got 1.0"),
    (["--optimizer.beta2", "1"], "optimizer.beta2 must be in [0, 1), got 1.0"),
    (["--lr_scheduler.decay_ratio", "1.5"], "lr_scheduler.decay_ratio must be in [0, 1] or -1, got 1.5"),
    (["--lr_scheduler.min_lr_factor", "-0.1"], "lr_scheduler.min_lr_factor must be in [0, 1], got -0.1"),
    (["--parallelism.data_parallel_shard_degree", "0"],
     "parallelism.data_parallel_shard_degree must be > 0 or -1 (the rest), got 0"),
    (["--parallelism.pipeline_parallel_split_points", "layers.2,block3"],
     "parallelism.pipeline_parallel_split_points: 'block3' is not a block name like 'layers.4'"),
    (["--checkpoint.load_step", "-2"], "checkpoint.load_step must be >= 0 or -1 (latest), got -2"),
    (["--metrics.save_tb_folder", ""], "metrics.save_tb_folder must name a folder under job.dump_folder, got ''"),
    (["--profiling.profile_freq", "-2"], "profiling.profile_freq must be > 0, got -2"),
    (["--profiling.save_traces_folder", ""], "profiling.save_traces_folder must name a folder"),
    (["--validation.steps", "0"], "validation.steps must be > 0 or -1, got 0"),
    (["--activation_checkpoint.selective_ac_option", "0"],
     "activation_checkpoint.selective_ac_option must be 'op' or a positive integer, got '0'"),
    (["--float8.enable", "--float8.enable_fsdp_float8_all_gather", "--float8.recipe", "rowwise"],
     "float8.enable_fsdp_float8_all_gather needs float8.recipe = 'tensorwise'"),
    (["--comm.trace_buf_size", "-1"], "comm.trace_buf_size must be >= 0, got -1"),
], ids=lambda v: v[0] if isinstance(v, list) else "")
def test_a_value_out_of_range_is_one_line_naming_the_key(argv, message):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_minus_one_means_the_rest_the_latest_or_all():
    cfg = parse_args(["--training.global_batch_size", "-1", "--parallelism.data_parallel_shard_degree", "-1",
                      "--checkpoint.load_step", "-1", "--validation.steps", "-1", "--lr_scheduler.decay_ratio", "-1"])
    assert (cfg.training.global_batch_size, cfg.parallelism.data_parallel_shard_degree, cfg.checkpoint.load_step,
            cfg.validation.steps, cfg.lr_scheduler.decay_ratio) == (-1, -1, -1, -1, -1.0)
