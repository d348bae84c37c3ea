from collections.abc import Sequence
from pathlib import Path

from titan.config.job_config import JobConfig
from titan.config.manager import ConfigError, ConfigManager, split_cli
from titan.config.torchtitan import translate

DEFAULT_CONFIG = Path(__file__).resolve().parents[3] / "configs" / "titan" / "debug.toml"
"""The file a titan command reads when given no --config. The dataclass defaults stay TorchTitan's, so that its
TOML files mean what they meant there."""

JOB_CONFIG = ConfigManager(JobConfig, "python -m titan.train [--config PATH.toml (default configs/titan/debug.toml)] "
                                      "[--section.key VALUE ...]", translate)
parse_args = JOB_CONFIG.parse_args
help_text = JOB_CONFIG.help_text
build_job_config = JOB_CONFIG.build
to_dict = JOB_CONFIG.to_dict
to_toml = JOB_CONFIG.to_toml


def parse_command_line(argv: Sequence[str], passthrough: Sequence[str] = ()) -> JobConfig:
    """A titan command's config: `parse_args`, with DEFAULT_CONFIG as the file when argv names none (where the
    package runs from its source tree; an installed copy without it falls back to the dataclass defaults)."""
    config_path, overrides = split_cli(list(argv))
    if not config_path and DEFAULT_CONFIG.is_file():
        config_path = str(DEFAULT_CONFIG)
    return JOB_CONFIG.load(config_path, overrides, passthrough)

__all__ = ["DEFAULT_CONFIG", "JOB_CONFIG", "ConfigError", "ConfigManager", "JobConfig", "build_job_config",
           "help_text", "parse_args", "parse_command_line", "to_dict", "to_toml"]
