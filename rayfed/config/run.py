"""The whole run's config, :class:`RunConfig`: its sections, the checks across them, and what each method entry
and architecture trains (:func:`method_model_config`, :func:`architecture_model_config`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pydantic
from pydantic import Field, SerializationInfo, SerializerFunctionWrapHandler, model_serializer, model_validator

from rayfed import registry
from rayfed.config.data import DataConfig
from rayfed.config.fields import Section, clean_message, is_built_method, plain_params, plugins
from rayfed.config.model import MODULE_FIELDS, ModelConfig
from rayfed.config.sections import (ArchitectureConfig, FederationConfig, MethodEntry, PlacementConfig, RayConfig,
                                    SystemConfig, TrainConfig)
from rayfed.config.tracking import TrackingConfig
from rayfed.errors import suggest


class RunConfig(Section):
    name: str = "run"
    seed: int = 0
    imports: tuple[str, ...] = Field(
        (), description="modules imported before plug-ins are looked up (their @rayfed.register_* decorators run)"
    )
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    federation: FederationConfig = FederationConfig()
    system: SystemConfig = SystemConfig()
    train: TrainConfig = TrainConfig()
    methods: tuple[MethodEntry, ...] = Field((MethodEntry(name="fedavg"),), min_length=1)
    placement: PlacementConfig = PlacementConfig()
    architectures: dict[str, ArchitectureConfig] | None = Field(
        None, description="clients of different backbones in one run: name -> {clients, backbone, model, placement}"
    )
    ray: RayConfig = RayConfig()
    tracking: TrackingConfig = Field(
        TrackingConfig(), description="experiment trackers (TensorBoard, Weights & Biases, MLflow) following the run "
        "(rayfed.tracking); recorded only when set"
    )
    tune: dict[str, Any] | None = Field(None, description="search spaces for `rayfed tune` (rayfed.tune)")

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        task_rounds = [task.clients_per_round for task in self.data.tasks or ()]
        if task_rounds and None not in task_rounds and self.federation.clients_per_round != sum(task_rounds):
            raise ValueError(
                f"federation.clients_per_round = {self.federation.clients_per_round} differs from the sum "
                f"{sum(task_rounds)} of data.tasks[*].clients_per_round (stratified sampling); set it to "
                f"{sum(task_rounds)}"
            )
        if self.federation.clients_per_round > self.data.num_clients:
            raise ValueError(
                f"federation.clients_per_round = {self.federation.clients_per_round} is larger than "
                f"data.num_clients = {self.data.num_clients}; it must be at most the number of clients"
            )
        for client_id in self.system.speeds:
            if not 0 <= client_id < self.data.num_clients:
                raise ValueError(
                    f"system.speeds names client {client_id}, but clients are 0..{self.data.num_clients - 1}"
                )
        labels = [m.label for m in self.methods]
        for label in labels:
            if labels.count(label) > 1:
                raise ValueError(f"methods: the label {label!r} is used twice; give each entry a distinct `label`")
        for index, entry in enumerate(self.methods):
            method_model_config(self.model, entry, index)
        match = self.train.compute_match
        if match is not None and self.train.local_steps is None:
            raise ValueError("train.compute_match scales train.local_steps, so it needs train.local_steps, not "
                             "train.local_epochs")
        if match is not None and match.reference not in labels:
            raise ValueError(f"train.compute_match.reference = {match.reference!r} is not a method label of this run; "
                             f"allowed: {', '.join(labels)}")
        if match is not None and match.client >= self.data.num_clients:
            raise ValueError(f"train.compute_match.client = {match.client} is not a client of this run; allowed: "
                             f"0..{self.data.num_clients - 1}")
        self._check_architectures()
        return self

    def _check_architectures(self) -> None:
        if self.architectures is None:
            return
        owner: dict[int, str] = {}
        for name, group in self.architectures.items():
            if not name or "/" in name:
                raise ValueError(f"architectures: the name {name!r} is invalid; use a non-empty name without '/'")
            for client in group.clients:
                if client in owner:
                    raise ValueError(f"architectures: client {client} is in both {owner[client]!r} and {name!r}; "
                                     "each client has one architecture")
                if not 0 <= client < self.data.num_clients:
                    raise ValueError(f"architectures.{name}.clients names client {client}, but clients are "
                                     f"0..{self.data.num_clients - 1}")
                owner[client] = name
            architecture_model_config(self, name)
        missing = [c for c in range(self.data.num_clients) if c not in owner]
        if missing:
            raise ValueError(f"architectures: client {missing[0]} is in no architecture; list every client "
                             f"0..{self.data.num_clients - 1} in exactly one")

    @model_serializer(mode="wrap")
    def _with_plugin_modules(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        """A dump imports the modules defining the user's plug-ins it names, so that it resolves them anywhere; an
        unset ``tracking`` section is left out, so that a run without trackers records what it did before them."""
        data = handler(self)
        if self.tracking == TrackingConfig():
            data.pop("tracking", None)
        if info.mode_is_json():
            modules = [module for _, module, qualname in user_plugins(self) if _importable(module, qualname)]
            data["imports"] = list(dict.fromkeys([*data["imports"], *modules]))
        return data

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def user_plugins(config: RunConfig) -> list[tuple[str, str, str]]:
    """``(field, module, qualified name)`` of every plug-in of the user's (not a built-in) that ``config`` names."""
    found = [(where, registry.defined_in(kind, value)) for where, kind, value in plugins(config)]
    return [(where, *defined) for where, defined in found if defined is not None]


def _importable(module: str, qualname: str) -> bool:
    return module != "__main__" and "<locals>" not in qualname


def rerun_notes(config: RunConfig) -> list[str]:
    """One sentence per plug-in of ``config`` that a rerun of its dump elsewhere cannot import, saying what to do."""
    return [
        f"{where}: {qualname} is defined in "
        f"{'the driver script (__main__)' if module == '__main__' else 'a function'}, "
        "so this config reruns only in that process; to rerun it with `rayfed run`, move "
        f"{qualname.rsplit('.', 1)[-1]} into a module and list that module under imports."
        for where, module, qualname in user_plugins(config) if not _importable(module, qualname)
    ]


def with_full_params(config: RunConfig, params: Sequence[Any]) -> RunConfig:
    """``config`` with each method entry given by name or class holding every hyperparameter of its built method
    (``params[i]``, its frozen dataclass, defaults included), so that the run's record names each value it used."""
    methods = tuple(entry if is_built_method(entry.name) else entry.model_copy(update={"params": plain_params(values)})
                    for entry, values in zip(config.methods, params))
    return config.model_copy(update={"methods": methods})


def model_configs(config: RunConfig) -> tuple[ModelConfig, ...]:
    """The model config of each of the run's architectures (``config.model`` for a run of one)."""
    return tuple(architecture_model_config(config, name) for name in (config.architectures or [""]))


def architecture_model_config(config: RunConfig, name: str) -> ModelConfig:
    """The model config of architecture ``name`` (``""``: the run's one architecture, ``config.model``)."""
    if not name:
        return config.model
    group = config.architectures[name]
    raw = {**config.model.model_dump(), **group.model, "backbone": group.backbone}
    _reset_implied(raw, group.model)
    try:
        return ModelConfig.model_validate(raw)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"architectures.{name}.model.{path} is invalid: {clean_message(first['msg'])}") from None


def method_model_config(model: ModelConfig, entry: MethodEntry, index: int = 0) -> ModelConfig:
    """The model config a method entry trains: ``model`` with the entry's module overrides."""
    if not entry.model:
        return model
    for key in entry.model:
        if key not in MODULE_FIELDS:
            raise ValueError(
                f"methods[{index}].model.{key} cannot be set per method{suggest(key, MODULE_FIELDS)}; "
                f"allowed: {', '.join(MODULE_FIELDS)} (the backbone is one per run)"
            )
    raw = model.model_dump(mode="json")
    _reset_implied(raw, entry.model)
    try:
        return ModelConfig.model_validate({**raw, **entry.model})
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        path = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"methods[{index}].model.{path} is invalid: {clean_message(first['msg'])}") from None


def _reset_implied(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Overrides of a model config: ``lora`` alone lets ``module`` follow it again, and another ``client`` starts
    from no options."""
    if "module" not in overrides and "lora" in overrides:
        raw["module"] = None
    if "client_options" not in overrides and "client" in overrides:
        raw["client_options"] = {}
