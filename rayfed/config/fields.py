"""What every config section is built from: the frozen section base, fields naming a plug-in, and the walk
over the plug-ins a config names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, PlainSerializer
from pydantic_core import to_jsonable_python

from rayfed import registry
from rayfed.errors import ConfigError

MOVED = "moved"  # the error type of a field that is no longer read, whose message says what to write instead


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


@dataclass(frozen=True)
class _PluginKind:
    """Marks a config field that names a plug-in of ``kind`` (see :func:`plugins`)."""

    kind: str


def _plugin(kind: str, optional: bool = False, recorded: Callable[[Any], Any] = lambda value: value) -> Any:
    """A config value naming a plug-in: a name, a ``"package.module:Name"`` string, or (from Python) the
    object itself, which a config dump writes as the registered name or import path of ``recorded(object)``."""

    def check(value: Any) -> Any:
        if value is None and optional:
            return value
        if value is None or isinstance(value, (bool, int, float, list, dict, tuple)):
            raise ValueError(f"it must be a name, a 'package.module:Name' string or a {kind} object")
        return value

    def dump(value: Any) -> Any:
        return value if value is None or isinstance(value, str) else registry.name_of(kind, recorded(value))

    return Annotated[Any, pydantic.AfterValidator(check), PlainSerializer(dump, when_used="json"), _PluginKind(kind)]


def is_built_method(method: Any) -> bool:
    """Whether a method entry's ``name`` is a built method (from Python) rather than a name or a class."""
    return not isinstance(method, (str, type))


def method_class(method: Any) -> Any:
    return type(method) if is_built_method(method) else method


def method_label(method: Any) -> str:
    """A method entry's default label: the name its class is registered under (the name written, for a name), else
    its class's name; the same whether it is given by name, as ``"module:Class"``, or from Python as its class or a
    built method."""
    if isinstance(method, str) and ":" not in method:
        return method
    if isinstance(method, str):
        try:
            method = registry.resolve("method", method).obj
        except ConfigError:  # not importable here: building the method says so, in one sentence
            return method.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    owner = method_class(method)
    return registry.registered_name("method", owner) or owner.__qualname__.rsplit(".", 1)[-1]


def plain_params(params: Any) -> dict[str, Any]:
    """A method's frozen dataclass of hyperparameters as plain YAML values (tuples as lists)."""
    return to_jsonable_python(dataclasses.asdict(params))


SourceName = _plugin("source")
PartitionerName = _plugin("partitioner")
BackboneName = _plugin("backbone")
ClientModelName = _plugin("client_model", optional=True)
TaskKindName = _plugin("task_kind", optional=True)
MethodName = _plugin("method", recorded=method_class)  # a built method: its class (its params: MethodEntry)


def plugins(section: BaseModel, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """``(field, kind, value)`` of every plug-in a config section names, in it and in its subsections
    (fields such as ``methods[1].name``, ``data.tasks[0].source``, ``architectures.big.backbone``)."""
    for name, field in type(section).model_fields.items():
        value, where = getattr(section, name), f"{path}{name}"
        kinds = [meta.kind for meta in field.metadata if isinstance(meta, _PluginKind)]
        if kinds:
            if value is not None:
                yield where, kinds[0], value
            continue
        if isinstance(value, tuple):
            children = [(f"{where}[{index}].", item) for index, item in enumerate(value)]
        elif isinstance(value, dict):
            children = [(f"{where}.{key}.", item) for key, item in value.items()]
        else:
            children = [(f"{where}.", value)]
        for prefix, child in children:
            if isinstance(child, BaseModel):
                yield from plugins(child, prefix)


def clean_message(msg: str) -> str:
    return msg.removeprefix("Value error, ").rstrip(".")


