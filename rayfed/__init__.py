"""rayfed: personalized federated learning of multi-modal foundation models, simulated on Ray.

What a driver script needs is importable from here: ``Simulation``, the config, the plug-in decorators
(``register_method``, ``register_source``, ``register_partitioner``, ``register_backbone``,
``register_client_model``, ``register_task_kind``, ``register_preparer``), the types plug-ins are written against (``Method``, ``Backbone``,
``TaskKind``, ...) and the ways uploads combine (``WeightedMean``, ``EachUpload``, ``Mixture``). See
``docs/extending.md``.
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
    "rayfed.fast_steps": "rayfed.training", "rayfed.scoring": "rayfed.training.scoring",
    "rayfed.public_pass": "rayfed.training.public_pass", "rayfed.batching": "rayfed.training.plans.stacked",
    "rayfed.training.fast_steps": "rayfed.training", "rayfed.training.batching": "rayfed.training.plans.stacked",
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
