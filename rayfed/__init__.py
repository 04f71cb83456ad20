"""rayfed: personalized federated learning of multi-modal foundation models, simulated on Ray.

The one module a driver script, a method or a client model imports from (``docs/extending.md``), in three sections
(each name loaded on first use, so that ``import rayfed`` starts neither torch nor Ray):

- **running**: ``Simulation``, the config (``RunConfig``, ``load_config``), ``ConfigError``, and the plug-in decorators
  (``register_method``, ``register_source``, ``register_partitioner``, ``register_backbone``,
  ``register_client_model``, ``register_task_kind``, ``register_preparer``);
- **a method**: ``Method`` and what its hooks take and return (``LocalResult``, ``Upload``, ``NoParams``, the state
  types and the named slots ``Slot``), the ways uploads combine (``WeightedMean``, ``EachUpload``, ``Mixture``) with
  their helpers (``weighted_mean``, ``weighted_sums``, ``mean_as``), its stages (``PreFederationStage``,
  ``PublicPassStage``, ``AfterFederationStage``) and what the client side trains with (``ClientContext``, ``Phase``,
  ``Step``, ``PreFederation``, ``PublicPass``, ``proximal_penalty``, ``distillation_loss``);
- **a model or data**: ``TrainableModule``, ``Backbone``, ``BackboneRequest``, ``ClientModelRequest``,
  ``default_client_model``, ``TaskKind``, ``ArrayDataset``, ``SourceRequest``, ``PartitionRequest``.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from rayfed.registry import (
    register,
    register_backbone,
    register_client_model,
    register_method,
    register_partitioner,
    register_preparer,
    register_source,
    register_task_kind,
)
from rayfed.version import __version__

if TYPE_CHECKING:
    from rayfed.aggregation import EachUpload, Mixture, WeightedMean, mean_as, weighted_mean, weighted_sums
    from rayfed.config import RunConfig, load_config
    from rayfed.data.partition import PartitionRequest
    from rayfed.data.sources import ArrayDataset, SourceRequest
    from rayfed.errors import ConfigError
    from rayfed.method import LocalResult, Method, NoParams, Upload
    from rayfed.models import Backbone, BackboneRequest, ClientModelRequest, TrainableModule, default_client_model
    from rayfed.simulation import Simulation
    from rayfed.stages import AfterFederationStage, PreFederationStage, PublicPassStage
    from rayfed.tasks.kinds import TaskKind
    from rayfed.training import (ClientContext, Phase, PreFederation, PublicPass, Step, distillation_loss,
                                 proximal_penalty)
    from rayfed.types import ClientState, ServerState, Slot, TensorDict

# Imported on first use so that `import rayfed` does not start torch and Ray: name -> its module.
_RUNNING = {"Simulation": "rayfed.simulation", "RunConfig": "rayfed.config", "load_config": "rayfed.config",
            "ConfigError": "rayfed.errors"}
_METHOD = {
    "Method": "rayfed.method", "LocalResult": "rayfed.method", "Upload": "rayfed.method", "NoParams": "rayfed.method",
    "TensorDict": "rayfed.types", "ClientState": "rayfed.types", "ServerState": "rayfed.types", "Slot": "rayfed.types",
    "WeightedMean": "rayfed.aggregation", "EachUpload": "rayfed.aggregation", "Mixture": "rayfed.aggregation",
    "weighted_mean": "rayfed.aggregation", "weighted_sums": "rayfed.aggregation", "mean_as": "rayfed.aggregation",
    "PreFederationStage": "rayfed.stages", "PublicPassStage": "rayfed.stages", "AfterFederationStage": "rayfed.stages",
    "ClientContext": "rayfed.training", "Phase": "rayfed.training", "Step": "rayfed.training",
    "PreFederation": "rayfed.training", "PublicPass": "rayfed.training", "proximal_penalty": "rayfed.training",
    "distillation_loss": "rayfed.training",
}
_MODEL_AND_DATA = {
    "TrainableModule": "rayfed.models", "Backbone": "rayfed.models", "BackboneRequest": "rayfed.models",
    "ClientModelRequest": "rayfed.models", "default_client_model": "rayfed.models", "TaskKind": "rayfed.tasks.kinds",
    "ArrayDataset": "rayfed.data.sources", "SourceRequest": "rayfed.data.sources",
    "PartitionRequest": "rayfed.data.partition",
}
_LAZY = {**_RUNNING, **_METHOD, **_MODEL_AND_DATA}

__all__ = [
    *_LAZY, "__version__", "register", "register_backbone", "register_client_model", "register_method",
    "register_partitioner", "register_preparer", "register_source", "register_task_kind",
]

# Modules that moved into subpackages: importing one by its old path fails in one sentence naming the new one.
MOVED_MODULES = {
    "rayfed.kinds": "rayfed.tasks.kinds", "rayfed.kind_protocols": "rayfed.tasks.kind_protocols",
    "rayfed.decoders": "rayfed.tasks.decoders", "rayfed.text_metrics": "rayfed.tasks.text_metrics",
    "rayfed.report": "rayfed.results.report", "rayfed.checkpoint": "rayfed.results.checkpoint",
    "rayfed.metrics": "rayfed.results.derived_metrics", "rayfed.modules": "rayfed.models.peft.modules",
    "rayfed.models.attach": "rayfed.models.peft.attach", "rayfed.lora_groups": "rayfed.models.peft.lora_groups",
    "rayfed.models.named_adapters": "rayfed.models.peft.named_adapters",
    "rayfed.benchmarks.offline_runs": "rayfed.methods.experiments.offline_runs",
    "rayfed.benchmarks.offline_twins": "rayfed.methods.experiments.offline_twins",
    "rayfed.client_context": "rayfed.training.client_context", "rayfed.optimizers": "rayfed.training.optimizers",
    "rayfed.fast_steps": "rayfed.training.fast_steps", "rayfed.scoring": "rayfed.training.scoring",
    "rayfed.public_pass": "rayfed.training.public_pass", "rayfed.batching": "rayfed.training.batching",
    "rayfed.streams": "rayfed.data.streams", "rayfed.clip": "rayfed.models.families.clip",
}  # fmt: skip


def _moved(old: str) -> str:
    return f"{old} moved to {MOVED_MODULES[old]}; import it from there."


class _MovedModuleFinder:
    """Asked before the other finders for a module not yet imported; answers only for the moved ones."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        if name in MOVED_MODULES:
            raise ImportError(_moved(name), name=name)


if not any(type(finder).__name__ == _MovedModuleFinder.__name__ for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if f"rayfed.{name}" in MOVED_MODULES:
        raise AttributeError(_moved(f"rayfed.{name}"))
    raise AttributeError(f"module 'rayfed' has no attribute {name!r}")
