"""The run's configuration, torch-free: the typed schema of every group (``schema``), the
strategy table (``strategies``), the loss table (``losses``), the data kinds
(``data_kinds``), the topology and its mesh
(``topology``), the rules a config must satisfy (``rules``) and the way in from Hydra
(``load``). Imports nothing else of ours.

Each config group's names (its module: ``sharding``, ``hardware``, ``model``, ``data``,
``training``, ``profiling``; the root ``Config`` in ``schema``), ``to_typed`` and
``register_schema`` are re-exported here: ``from
fsdp_lab.config import Config, to_typed`` is how the other packages read them.
"""

from fsdp_lab.config.data import (
    ChatLayout,
    DataConfig,
    Overlong,
    Packing,
    TokenDtype,
    TrainOn,
)
from fsdp_lab.config.data_kinds import DataKind
from fsdp_lab.config.errors import ConfigError, first_line, typed_command
from fsdp_lab.config.evaluation import HARNESS_EXTRA, EvalConfig
from fsdp_lab.config.hardware import Backend, HardwareConfig, HardwareKind, StartMethod
from fsdp_lab.config.load import compose, register_schema, to_typed
from fsdp_lab.config.model import (
    ExpertsImplementation,
    FinetuneConfig,
    FinetuneMethod,
    ModelArch,
    ModelConfig,
    ModelTask,
    QuantizeBase,
    WeightLoading,
)
from fsdp_lab.config.profiling import ProfileConfig, ProfileMode
from fsdp_lab.config.schema import Config, Objective, to_container
from fsdp_lab.config.sharding import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    Dtype,
    Float8Recipe,
    OffloadConfig,
    OffloadDevice,
    ParallelConfig,
    PrecisionConfig,
    PrefetchConfig,
    ShardingConfig,
    ShardingStrategy,
    WrapConfig,
    WrapPolicy,
)
from fsdp_lab.config.training import (
    CheckpointConfig,
    CheckpointFormat,
    CheckpointVerify,
    LossConfig,
    LossKind,
    OnSaveError,
    OptimConfig,
    OptimImpl,
    TrainerConfig,
)

__all__ = [
    "HARNESS_EXTRA",
    "ActivationCheckpointingConfig",
    "ActivationCheckpointingMode",
    "Backend",
    "ChatLayout",
    "CheckpointConfig",
    "CheckpointFormat",
    "CheckpointVerify",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataKind",
    "Dtype",
    "EvalConfig",
    "ExpertsImplementation",
    "FinetuneConfig",
    "FinetuneMethod",
    "Float8Recipe",
    "HardwareConfig",
    "HardwareKind",
    "LossConfig",
    "LossKind",
    "ModelArch",
    "ModelConfig",
    "ModelTask",
    "Objective",
    "OffloadConfig",
    "OffloadDevice",
    "OnSaveError",
    "OptimConfig",
    "OptimImpl",
    "Overlong",
    "Packing",
    "ParallelConfig",
    "PrecisionConfig",
    "PrefetchConfig",
    "ProfileConfig",
    "ProfileMode",
    "QuantizeBase",
    "ShardingConfig",
    "ShardingStrategy",
    "StartMethod",
    "TokenDtype",
    "TrainOn",
    "TrainerConfig",
    "WeightLoading",
    "WrapConfig",
    "WrapPolicy",
    "compose",
    "first_line",
    "register_schema",
    "to_container",
    "to_typed",
    "typed_command",
]
