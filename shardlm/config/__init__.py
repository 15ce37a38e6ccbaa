"""The run configuration: dataclasses (schema), YAML files and dotted `key=value` overrides (loading), checks
with the nearest valid key or choice (checks, suggest). The names below are the package's public API:
`from shardlm.config import load_config, Config` reads the same whatever module holds them."""

from shardlm.config.loading import (
    BUNDLED_CONFIGS,
    build_config,
    bundled_configs,
    config_from_dict,
    config_path,
    config_summary,
    load_config,
    parse_overrides,
    save_config,
    split_args,
    task_defaults_note,
    to_dict,
    to_flat_dict,
)
from shardlm.config.schema import (
    KEY_ALIASES,
    CheckpointConfig,
    Config,
    DataConfig,
    DistillConfig,
    GrpoConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    PreferenceConfig,
    TrainConfig,
    all_keys,
)
from shardlm.config.suggest import nearest

__all__ = ["BUNDLED_CONFIGS", "KEY_ALIASES", "CheckpointConfig", "Config", "DataConfig", "DistillConfig", "GrpoConfig",
           "LogConfig", "LoraConfig", "ModelConfig", "ParallelConfig", "PreferenceConfig", "TrainConfig", "all_keys",
           "build_config", "bundled_configs",
           "config_from_dict", "config_path", "config_summary", "load_config", "nearest", "parse_overrides",
           "save_config", "split_args", "task_defaults_note", "to_dict", "to_flat_dict"]
