"""The config system: defaults < TOML < --section.key overrides, typed, validated, one-line errors."""

import dataclasses
from pathlib import Path

import pytest

from titan.config import ConfigError, JobConfig, help_text, parse_args, to_toml
from titan.config.manager import field_docs

REPO = Path(__file__).resolve().parents[3]


def test_defaults_are_the_debug_run():
    cfg = parse_args([])
    assert cfg == JobConfig()
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "debug")
    assert cfg.dump_folder == "./outputs/debug"


def test_toml_round_trip(tmp_path):
    cfg = parse_args(["--training.steps", "7", "--optimizer.betas", "0.8,0.99", "--checkpoint.enable",
                      "--checkpoint.exclude_from_loading", "optimizer,dataloader", "--job.description", 'a "q"'])
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    assert parse_args(["--config", str(path)]) == cfg


def test_cli_overrides_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[training]\nsteps = 5\nseq_len = 64\n[optimizer]\nlr = 1\n")
    cfg = parse_args(["--config", str(path), "--training.steps=9"])
    assert cfg.training.steps == 9 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)


def test_type_conversion_of_overrides():
    cfg = parse_args(["--metrics.enable_tensorboard", "false", "--training.max_norm", "0.5",
                      "--parallelism.pipeline_parallel_schedule", "GPipe", "--debug.deterministic"])
    assert cfg.metrics.enable_tensorboard is False
    assert cfg.training.max_norm == 0.5
    assert cfg.parallelism.pipeline_parallel_schedule == "GPipe"
    assert cfg.debug.deterministic is True


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.steps", "x"], "training.steps must be an integer"),
        (["--nosuch.key", "1"], "unknown config section [nosuch]"),
        (["--training.nosuch", "1"], "unknown key training.nosuch"),
        (["--activation_checkpoint.mode", "half"], "one of 'none', 'full', 'selective'"),
        (["--metrics.enable_tensorboard", "maybe"], "true or false"),
        (["--checkpoint.exclude_from_loading", "weights"], "unknown ['weights']"),
        (["training.steps", "3"], "unexpected argument"),
        (["--steps", "3"], "must look like --section.key"),
        (["--debug.distributed_debug", "verbose"], "one of 'off', 'info', 'detail'"),
    ],
)
def test_bad_cli_values_raise_one_line(argv, fragment):
    with pytest.raises(ConfigError) as err:
        parse_args(argv)
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[training\nsteps = 3", "not valid TOML"),
        ("[training]\nsteps = '3'", "training.steps must be an integer"),
        ("[training]\nsteps = 3.5", "training.steps must be an integer"),
        ("[training]\nbogus = 1", "unknown key training.bogus"),
        ("[bogus]\nx = 1", "unknown config section [bogus]"),
        ("steps = 3", "must be a [section] table"),
        ("[checkpoint]\nenable = 1", "checkpoint.enable must be true or false"),
    ],
)
def test_bad_toml_raises_one_line(tmp_path, text, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        parse_args(["--config", str(path)])
    assert fragment in str(err.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--config", "/nonexistent/x.toml"])


def test_every_field_is_documented_in_help():
    text = help_text()
    for section in dataclasses.fields(JobConfig):
        cls = type(getattr(JobConfig(), section.name))
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section.name}.{f.name} has no docstring"
            key = "<field>" if f.name == getattr(cls, "OPEN_KEYS", "") else f.name
            assert f"--{section.name}.{key} " in text


@pytest.mark.parametrize("path", sorted((REPO / "configs" / "titan").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    parse_args(["--config", str(path)])
