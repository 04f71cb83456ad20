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
from typing import TYPE_CHECKING, Any

from rayfed.compat import MOVED_MODULES, install_moved_module_finder, moved_module
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
    from rayfed.training import (CapturedLoss, ClientContext, Phase, PreFederation, PublicPass, Step,
                                 distillation_loss, proximal_penalty)
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
    "distillation_loss": "rayfed.training", "CapturedLoss": "rayfed.training",
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

install_moved_module_finder()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if (moved := moved_module(f"rayfed.{name}")) is not None:
        raise AttributeError(moved)
    raise AttributeError(f"module 'rayfed' has no attribute {name!r}")
