"""The client-model plug-in kind: which model a method trains over the backbone.

``model.client`` names a builder registered with :func:`rayfed.register_client_model` (or a ``"module:Name"``
string, or the function itself), ``model.client_options`` its options; a method entry's own ``model:`` may set
both for that method alone. Unset, the model is the engine's :class:`~rayfed.models.ClientModel`: the
backbone with ``model.module`` and a head per task (:func:`~rayfed.models.build_task_model`).

A builder is a function ``(request: ClientModelRequest) -> TrainableModule`` that checks its options itself and
says what is wrong in one sentence naming ``model.client_options.<option>``. A method that trains named adapter
sets (e.g. shared, frozen and local adapters) asks for them through ``request.adapter_sets``; a builder
either places them at its adapter sites or refuses.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from rayfed import registry
from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.models.peft.attach import attach_adapter_set
from rayfed.models.backbone import Backbone
from rayfed.models.build import build_task_model
from rayfed.models.client import TrainableModule
from rayfed.tasks import Task

OPTIONS_FIELD = "model.client_options"
_BUILT: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("client_models_built", default=None)


@dataclass(frozen=True)
class AdapterSets:
    """Named adapters a method trains at every adapter site of its model: ``shared`` among ``names`` (the one a
    site's forward uses unless a mixture is set, :func:`rayfed.models.peft.modules.set_adapter_mix`), the ``frozen``
    ones not trainable. ``method`` names the asking method in error messages."""

    names: tuple[str, ...]
    frozen: tuple[str, ...] = ()
    method: str = ""


@dataclass(frozen=True)
class ClientModelRequest:
    """What a client-model builder gets: the backbone (its private copy to build on), the method's model config,
    the run's tasks, the seed its initial values may depend on (only on it, so every actor builds the same model)
    and the adapter sets the method trains, if any."""

    backbone: Backbone
    config: ModelConfig
    tasks: Sequence[Task]
    seed: int
    adapter_sets: AdapterSets | None = None

    @property
    def options(self) -> dict[str, Any]:
        """``model.client_options``."""
        return dict(self.config.client_options)


def client_model(backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
                 adapter_sets: AdapterSets | None = None) -> TrainableModule:
    """The model ``config.client`` chooses (unset: :func:`default_client_model`), built for ``tasks``."""
    request = ClientModelRequest(backbone, config, tuple(tasks), seed, adapter_sets)
    if config.client is None:
        return default_client_model(request)
    resolved = registry.resolve("client_model", config.client)
    if (built := _BUILT.get()) is not None:
        built.append(resolved.name)
    model = resolved.obj(request)
    if not isinstance(model, TrainableModule):
        raise ConfigError(f"model.client = {resolved.name!r} built a {type(model).__name__}, not a "
                          "rayfed.TrainableModule (whose trainable parameters the engine reads and loads).")
    if adapter_sets is not None and not _has_adapter_set(model, adapter_sets.names[0]):
        raise ConfigError(f"model.client = {resolved.name!r} built no {adapter_sets.names[0]!r} adapters, which "
                          f"methods ({adapter_sets.method}) trains; choose a client model with adapter sets.")
    return model


@contextlib.contextmanager
def client_models_built() -> Iterator[list[str]]:
    """The names of the ``model.client`` models :func:`client_model` builds inside the block (a method that builds
    a model of its own builds none, whatever ``model.client`` says)."""
    built: list[str] = []
    token = _BUILT.set(built)
    try:
        yield built
    finally:
        _BUILT.reset(token)


def default_client_model(request: ClientModelRequest) -> TrainableModule:
    """The engine's model: the backbone with ``model.module`` and a head per task; with adapter sets, the heads
    and the sets at every site of ``model.adapter`` (``model.module`` must be ``adapter``)."""
    backbone, config, tasks, seed = request.backbone, request.config, request.tasks, request.seed
    sets = request.adapter_sets
    if sets is None:
        return build_task_model(backbone, config, tasks, seed)
    if config.module != "adapter":
        raise ConfigError(f"methods ({sets.method}) trains adapters, but model.module = {config.module!r}; set "
                          "model.module = 'adapter', or model.client to a client model with adapter sets.")
    model = build_task_model(backbone, config.model_copy(update={"module": "head"}), tasks, seed)
    attach_adapter_set(model, config, sets.names, seed, frozen=sets.frozen)
    return model


def _has_adapter_set(model: nn.Module, name: str) -> bool:
    return any(f".adapters.{name}." in parameter for parameter, _ in model.named_parameters())
