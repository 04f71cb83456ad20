"""rayfed: personalized federated learning of multi-modal foundation models, simulated on Ray.

What a driver script needs is importable from here: ``Simulation``, the config, the plug-in decorators
(``register_method``, ``register_source``, ``register_partitioner``, ``register_backbone``,
``register_client_model``, ``register_task_kind``, ``register_preparer``), the types plug-ins are written against (``Method``, ``Backbone``,
``TaskKind``, ...) and the ways uploads combine (``WeightedMean``, ``EachUpload``, ``Mixture``). See
``docs/extending.md``.
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
    from rayfed.aggregation import EachUpload, Mixture, WeightedMean
    from rayfed.config import RunConfig, load_config
    from rayfed.data.partition import PartitionRequest
    from rayfed.data.sources import ArrayDataset, SourceRequest
    from rayfed.tasks.kinds import TaskKind
    from rayfed.method import LocalResult, Method, Upload
    from rayfed.models import Backbone, BackboneRequest, ClientModelRequest, TrainableModule
    from rayfed.simulation import Simulation
    from rayfed.training import ClientContext, Phase, Step

# Imported on first use so that `import rayfed` does not start torch and Ray.
_LAZY = {
    "Simulation": "rayfed.simulation", "RunConfig": "rayfed.config", "load_config": "rayfed.config",
    "Method": "rayfed.method", "LocalResult": "rayfed.method", "Upload": "rayfed.method",
    "Backbone": "rayfed.models", "BackboneRequest": "rayfed.models", "ClientModelRequest": "rayfed.models",
    "TrainableModule": "rayfed.models", "TaskKind": "rayfed.tasks.kinds",
    "ArrayDataset": "rayfed.data.sources", "SourceRequest": "rayfed.data.sources",
    "PartitionRequest": "rayfed.data.partition", "ClientContext": "rayfed.training", "Phase": "rayfed.training",
    "Step": "rayfed.training", "WeightedMean": "rayfed.aggregation", "EachUpload": "rayfed.aggregation",
    "Mixture": "rayfed.aggregation",
}  # fmt: skip

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
