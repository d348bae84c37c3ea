from titan.config.job_config import JobConfig
from titan.config.manager import ConfigError, ConfigManager
from titan.config.torchtitan import translate

JOB_CONFIG = ConfigManager(JobConfig, "python -m titan.train [--config PATH.toml] [--section.key VALUE ...]", translate)
parse_args = JOB_CONFIG.parse_args
help_text = JOB_CONFIG.help_text
build_job_config = JOB_CONFIG.build
to_dict = JOB_CONFIG.to_dict
to_toml = JOB_CONFIG.to_toml

__all__ = ["JOB_CONFIG", "ConfigError", "ConfigManager", "JobConfig", "build_job_config", "help_text", "parse_args",
           "to_dict", "to_toml"]
