from titan.config.job_config import JobConfig
from titan.config.manager import ConfigError, build_job_config, help_text, parse_args, to_dict, to_toml

__all__ = ["ConfigError", "JobConfig", "build_job_config", "help_text", "parse_args", "to_dict", "to_toml"]
