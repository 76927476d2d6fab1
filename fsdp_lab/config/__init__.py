"""The run's configuration, torch-free: the typed schema of every group (``schema``), the
strategy table (``strategies``), the topology and its mesh (``topology``), the rules a config
must satisfy (``rules``) and the way in from Hydra (``load``). Imports nothing else of ours.

The schema's names, ``to_typed`` and ``register_schema`` are re-exported here: ``from
fsdp_lab.config import Config, to_typed`` is how the other packages read them.
"""

from fsdp_lab.config.load import register_schema, to_typed
from fsdp_lab.config.schema import (
    ActivationCheckpointingConfig, ActivationCheckpointingMode, CheckpointConfig,
    CheckpointFormat, Config, ConfigError, DataConfig, DataKind, Dtype, HardwareConfig,
    HardwareKind, LoggerConfig, LoggerKind, LossConfig, LossKind, ModelArch, ModelConfig,
    ModelTask, OffloadConfig, OffloadDevice, OptimConfig, OptimImpl, PrecisionConfig,
    PrefetchConfig, ShardingConfig, ShardingStrategy, TrainerConfig, WandbMode, WrapConfig,
    WrapPolicy, to_container,
)

__all__ = [
    'ActivationCheckpointingConfig', 'ActivationCheckpointingMode', 'CheckpointConfig',
    'CheckpointFormat', 'Config', 'ConfigError', 'DataConfig', 'DataKind', 'Dtype',
    'HardwareConfig', 'HardwareKind', 'LoggerConfig', 'LoggerKind', 'LossConfig', 'LossKind',
    'ModelArch', 'ModelConfig', 'ModelTask', 'OffloadConfig', 'OffloadDevice', 'OptimConfig',
    'OptimImpl', 'PrecisionConfig', 'PrefetchConfig', 'ShardingConfig', 'ShardingStrategy',
    'TrainerConfig', 'WandbMode', 'WrapConfig', 'WrapPolicy', 'register_schema', 'to_container',
    'to_typed',
]
