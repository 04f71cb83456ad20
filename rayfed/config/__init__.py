"""Run configuration: YAML -> validated, frozen pydantic objects.

Every invalid value is reported as one sentence naming the field, the value and what is
allowed (see :func:`load_config`). The sections live in :mod:`rayfed.config.data`, :mod:`rayfed.config.model`,
:mod:`rayfed.config.sections` and :mod:`rayfed.config.tracking`, the whole run in :mod:`rayfed.config.run`, loading in
:mod:`rayfed.config.loading`; every public name is importable from here.
"""

from rayfed.config.data import DataConfig, OnePerGroupConfig, PartitionConfig, StreamConfig, TaskDataConfig
from rayfed.config.fields import (BackboneName, ClientModelName, MethodName, PartitionerName, Section, SourceName,
                                  TaskKindName, plugins)
from rayfed.config.loading import apply_overrides, build_config, dump_config, load_config, parse_overrides
from rayfed.config.model import (MODULE_FIELDS, MODULES, AdapterConfig, LoraConfig, ModelConfig, PromptConfig,
                                 VptConfig)
from rayfed.config.run import (RunConfig, architecture_model_config, method_model_config, model_configs, rerun_notes,
                               user_plugins, with_full_params)
from rayfed.config.sections import (ArchitectureConfig, ComputeMatch, FederationConfig, MethodEntry, PlacementConfig,
                                    Positive, Probability, RayConfig, SystemConfig, TrainConfig)
from rayfed.config.tracking import MlflowTracking, TensorBoardTracking, TrackingConfig, WandbTracking

__all__ = [
    "MODULES", "MODULE_FIELDS", "AdapterConfig", "ArchitectureConfig", "BackboneName", "ClientModelName",
    "ComputeMatch", "DataConfig", "FederationConfig", "LoraConfig", "MethodEntry", "MethodName", "MlflowTracking",
    "ModelConfig", "OnePerGroupConfig", "PartitionConfig", "PartitionerName", "PlacementConfig", "Positive",
    "Probability", "PromptConfig", "RayConfig", "RunConfig", "Section", "SourceName", "StreamConfig", "SystemConfig",
    "TaskDataConfig", "TaskKindName", "TensorBoardTracking", "TrackingConfig", "TrainConfig", "VptConfig",
    "WandbTracking",
    "apply_overrides", "architecture_model_config", "build_config", "dump_config", "load_config", "method_model_config",
    "model_configs", "parse_overrides", "plugins", "rerun_notes", "user_plugins", "with_full_params",
]
