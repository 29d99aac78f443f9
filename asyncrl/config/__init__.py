"""The run configuration: a typed schema, loaded from YAML plus overrides.

``load_config("configs/quickstart.yaml", ["buffer.max_staleness=2"])`` returns a
validated :class:`Config` or raises :class:`ConfigError`, whose message holds
one line per problem, each naming where it came from (``file:line`` or the
override), the key path, and what was expected; an unknown key also names the
closest valid one. Every error is reported at once, before any process starts.

This package imports no torch (and nothing of the learner: it is the bottom layer), so
``asyncrl --help`` and validation stay fast. One module per group of sections
(:mod:`.run`, :mod:`.data`, :mod:`.algorithm`, :mod:`.buffer`, :mod:`.learner`,
:mod:`.generators`, :mod:`.cluster`), the root :class:`Config` in :mod:`.schema`,
reading and overrides in :mod:`.loading`, messages in :mod:`.errors`.
"""

from asyncrl.config.algorithm import (
    ADVANTAGE_CONFIGS,
    AlgorithmConfig,
    CriticConfig,
    DiscountedConfig,
    DrGrpoConfig,
    GaeConfig,
    GrpoConfig,
    ReinforcePPConfig,
    RlooConfig,
    register_advantage_config,
)
from asyncrl.config.base import MAX_PROCESSES, MAX_TOKENS, ConfigError
from asyncrl.config.buffer import BufferConfig
from asyncrl.config.cluster import ClusterConfig
from asyncrl.config.data import DataConfig, EvalConfig, RewardConfig, TaskConfig
from asyncrl.config.generators import GeneratorsConfig, Pool, PoolConfig
from asyncrl.config.learner import LearnerConfig
from asyncrl.config.loading import config_from_dict, load_config, save_config
from asyncrl.config.run import LoraConfig, ModelConfig, RunConfig, TinyModelConfig, TrackingConfig
from asyncrl.config.schema import Config, config_warnings
from asyncrl.config.weights import WeightsConfig
from asyncrl.core.machine import machine_problems
from asyncrl.core.yaml_files import MAX_CONFIG_BYTES

__all__ = [
    "ADVANTAGE_CONFIGS",
    "MAX_CONFIG_BYTES",
    "MAX_PROCESSES",
    "MAX_TOKENS",
    "AlgorithmConfig",
    "BufferConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DiscountedConfig",
    "DrGrpoConfig",
    "EvalConfig",
    "GaeConfig",
    "GeneratorsConfig",
    "GrpoConfig",
    "LearnerConfig",
    "LoraConfig",
    "ModelConfig",
    "Pool",
    "PoolConfig",
    "ReinforcePPConfig",
    "RewardConfig",
    "RlooConfig",
    "RunConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TrackingConfig",
    "WeightsConfig",
    "config_from_dict",
    "config_warnings",
    "load_config",
    "machine_problems",
    "register_advantage_config",
    "save_config",
]
