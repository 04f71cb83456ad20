"""The one plug-in mechanism, for everything a user may bring.

A method, a data source, a partitioner, a backbone, a client model and a task kind are each given (in a config, or in a
``Simulation(...)`` call from Python), and a benchmark's preparer on ``rayfed prepare``'s command line, as

- a registered name (``fedavg``, ``sklearn:digits``, ``dirichlet``, ``tiny:vit``, ``classification``),
  including prefix entries that take the rest of the name as their argument (``hf:<dataset>``);
- an importable ``"package.module:Name"`` string;
- or, from Python, the object itself.

Built-ins register through the same decorators as users (``@register_method("fedavg")``). The modules that
register plug-ins are listed once, as entry points of the group ``rayfed.plugins`` (rayfed's own in pyproject.toml,
the engine's and the papers' alike; another installed distribution may add its own): the first look-up of any kind
imports every listed module (:func:`load_plugins`). What a driver script registers is shipped to the actors
with the run (:func:`user_entries`, :func:`install`), so a class defined in a user's ``__main__`` works on
every actor.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rayfed.errors import ConfigError, suggest

T = TypeVar("T")

# kind -> the config field it is named in (for error messages)
KINDS: dict[str, str] = {
    "method": "methods[i].name",
    "source": "data.source",
    "partitioner": "data.partition.name",
    "backbone": "model.backbone",
    "client_model": "model.client",
    "task_kind": "data.kind",
    "preparer": "benchmark",  # rayfed prepare BENCHMARK
}
PLUGIN_GROUP = "rayfed.plugins"  # the entry-point group listing the modules that register plug-ins


@dataclass(frozen=True)
class Entry:
    """One registered plug-in. A ``prefix`` entry (its name ends with ``:``) answers every name that starts
    with it and receives the rest as its argument."""

    kind: str
    name: str
    obj: Any
    builtin: bool
    help: str = ""

    @property
    def prefix(self) -> bool:
        return self.name.endswith(":")


@dataclass(frozen=True)
class Resolved:
    """A plug-in as resolved from a config value: the object, the name it goes by, and a prefix's argument."""

    obj: Any
    name: str
    argument: str | None = None


_ENTRIES: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
_plugins_loaded = False


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"plug-in kind {kind!r} is not one of {', '.join(KINDS)}")


def register(kind: str, name: str, obj: T | None = None, *, help: str = "") -> T | Callable[[T], T]:
    """Register ``obj`` as plug-in ``name`` of ``kind``; without ``obj``, a decorator.

    A name ending with ``:`` is a prefix: ``register("source", "mydata:", load)`` makes ``mydata:train``
    resolve to ``load`` with the argument ``"train"``. Registering a name again replaces the entry.
    """
    _check_kind(kind)
    if not name or any(c.isspace() for c in name):
        raise ConfigError(f"a {kind} plug-in name must be a non-empty word, not {name!r}.")

    def add(target: T) -> T:
        text = help or _first_sentence(getattr(target, "__doc__", None) or "")
        # An object a user built from a built-in class (an instance) is the user's, not a built-in.
        defined = isinstance(target, type) or callable(target)
        builtin = defined and str(getattr(target, "__module__", "")).startswith("rayfed.")
        _ENTRIES[kind][name] = Entry(kind, name, target, builtin, text)
        return target

    return add if obj is None else add(obj)


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def register_method(name: str) -> Callable[[T], T]:
    """Decorator: ``@rayfed.register_method("fedavgm")`` on a :class:`~rayfed.method.Method` subclass."""
    return register("method", name)


def register_source(name: str) -> Callable[[T], T]:
    """Decorator on a function ``(request: SourceRequest) -> dataset`` (see ``docs/extending.md``)."""
    return register("source", name)


def register_partitioner(name: str) -> Callable[[T], T]:
    """Decorator on a function ``(request: PartitionRequest) -> list of index arrays``, one per client, or a
    :class:`~rayfed.data.partition.Partition` (train and test cut, label spaces, shared tests)."""
    return register("partitioner", name)


def register_backbone(name: str) -> Callable[[T], T]:
    """Decorator on a function ``(request: BackboneRequest) -> Backbone``."""
    return register("backbone", name)


def register_client_model(name: str) -> Callable[[T], T]:
    """Decorator on a function ``(request: ClientModelRequest) -> TrainableModule``: the model a method trains over
    the backbone, chosen by ``model.client`` (see :mod:`rayfed.models.client_plugin`)."""
    return register("client_model", name)


def register_task_kind(name: str) -> Callable[[T], T]:
    """Decorator on a :class:`~rayfed.tasks.kinds.TaskKind` subclass (instantiated without arguments)."""
    return register("task_kind", name)


def register_preparer(name: str) -> Callable[[T], T]:
    """Decorator on a function ``(request: PrepareRequest) -> None`` that builds benchmark ``name``'s folders from its
    public files (``rayfed prepare NAME``; see :mod:`rayfed.data.prepare`)."""
    return register("preparer", name)


def plugin_modules() -> list[str]:
    """The modules listed under the entry-point group ``rayfed.plugins``, each once: rayfed's own first, the engine's
    before the methods' (so a kind's built-ins register in the same order however the list is sorted), then other
    installed distributions'."""
    listed = importlib.metadata.entry_points(group=PLUGIN_GROUP)
    own = [point.value for point in listed if _distribution(point) == "rayfed"] or checkout_plugin_modules()
    own = sorted(own, key=lambda module: module.startswith("rayfed.methods."))
    if not own:
        raise ConfigError(f"rayfed's installed metadata lists no {PLUGIN_GROUP} entry points (pyproject.toml's "
                          f"[project.entry-points.\"{PLUGIN_GROUP}\"]): reinstall rayfed (pip install -e .).")
    return list(dict.fromkeys([*own, *(point.value for point in listed if _distribution(point) != "rayfed")]))


def checkout_plugin_modules(pyproject: Path = Path(__file__).resolve().parents[1] / "pyproject.toml") -> list[str]:
    """The list in a source checkout's pyproject.toml, for rayfed run from the checkout without being installed
    (``PYTHONPATH``, as on a GPU host that cannot install); empty when there is none to read."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: installing is the way
        return []
    if not pyproject.is_file():
        return []
    return list(tomllib.loads(pyproject.read_text())["project"].get("entry-points", {}).get(PLUGIN_GROUP, {}).values())


def _distribution(point: importlib.metadata.EntryPoint) -> str | None:
    return point.dist.name if point.dist is not None else None


def load_plugins() -> None:
    """Import every module :func:`plugin_modules` lists (once per process), which registers their plug-ins."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    modules = plugin_modules()
    _plugins_loaded = True  # before importing: a listed module may look a name up while it loads
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            if module.startswith("rayfed."):
                raise
            raise ConfigError(f"plug-in module {module!r} (listed under the entry-point group {PLUGIN_GROUP}) cannot "
                              f"be imported ({err}).") from None


def entries(kind: str) -> list[Entry]:
    """Every registered plug-in of ``kind``, built-ins first, each group in registration order."""
    _check_kind(kind)
    load_plugins()
    registered = list(_ENTRIES[kind].values())
    return [e for e in registered if e.builtin] + [e for e in registered if not e.builtin]


def names(kind: str) -> list[str]:
    """The names a config may use for ``kind`` (prefix entries shown as ``prefix<...>``)."""
    return [entry.name + ("<...>" if entry.prefix else "") for entry in entries(kind)]


def resolve(kind: str, value: Any, field: str | None = None) -> Resolved:
    """The plug-in ``value`` names (or is); one sentence naming ``field`` and the choices if there is none."""
    _check_kind(kind)
    field = field or KINDS[kind]
    if not isinstance(value, str):
        return Resolved(value, name_of(kind, value))
    load_plugins()
    entry = _registered(kind, value)
    if entry is not None:
        return Resolved(entry.obj, value, value[len(entry.name):] if entry.prefix else None)
    allowed = names(kind)
    unknown = ConfigError(
        f"{field} = {value!r} is not known{suggest(value, allowed)}; allowed: {', '.join(allowed)}, "
        "or an importable 'package.module:Name'."
    )
    if ":" not in value:
        raise unknown
    try:
        return Resolved(import_object(value, field), value)
    except ConfigError:
        if suggest(value, allowed):  # a misspelt registered name (sklearn:digit), not an import path
            raise unknown from None
        raise


def _registered(kind: str, name: str) -> Entry | None:
    """The entry answering ``name``: the one registered under it, else the longest prefix it starts with."""
    registered = _ENTRIES[kind]
    if name in registered:
        return registered[name]
    prefixes = [entry for entry in registered.values() if entry.prefix and name.startswith(entry.name)]
    return max(prefixes, key=lambda entry: len(entry.name), default=None)


def import_object(path: str, field: str) -> Any:
    """The object named by ``"package.module:Name"`` (``Name`` may be dotted: ``module:Class.attr``)."""
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{field} = {path!r} is not of the form 'package.module:Name'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{field} = {path!r}: module {module_name!r} cannot be imported ({err}).") from None
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            available = [n for n in dir(target) if not n.startswith("_")]
            raise ConfigError(
                f"{field} = {path!r}: module {module_name!r} has no attribute {attribute!r}{suggest(part, available)}."
            )
        target = getattr(target, part)
    return target


def name_of(kind: str, obj: Any) -> str:
    """The name a config dump gives ``obj``: its registered name, else ``"module:QualifiedName"``, under which
    it is then registered (so that the dumped config resolves to the same object, here and on the actors)."""
    for entry in _ENTRIES[kind].values():
        if entry.obj is obj and not entry.prefix:
            return entry.name
    name = import_path_of(obj)
    register(kind, name, obj)
    return name


def import_path_of(obj: Any) -> str:
    """``"module:QualifiedName"`` of ``obj`` (an instance: of its class)."""
    owner = obj if isinstance(obj, type) or callable(obj) else type(obj)
    qualname = getattr(owner, "__qualname__", type(owner).__qualname__)
    return f"{getattr(owner, '__module__', '__main__')}:{qualname}"


def registered_name(kind: str, obj: Any) -> str | None:
    """The name ``obj`` was registered under in this process (the first, not a prefix nor its own import path, which
    :func:`name_of` registers), or None."""
    path = import_path_of(obj)
    return next((entry.name for entry in _ENTRIES[kind].values()
                 if entry.obj is obj and not entry.prefix and entry.name != path), None)


def defined_in(kind: str, value: Any) -> tuple[str, str] | None:
    """Where the user's plug-in ``value`` (a registered name, or the object: an instance stands for its class) is
    defined, as ``(module, qualified name)``; None for a built-in, and for a name this process has not registered
    (an import path, which a config resolves by itself)."""
    _check_kind(kind)
    if isinstance(value, str):
        entry = _registered(kind, value)
        if entry is None or entry.builtin:
            return None
        value = entry.obj
    owner = value if isinstance(value, type) or callable(value) else type(value)
    module = str(getattr(owner, "__module__", None) or "__main__")
    if module.startswith("rayfed."):
        return None
    return module, getattr(owner, "__qualname__", type(owner).__qualname__)


def user_entries() -> list[Entry]:
    """What this process registered beyond the built-ins: shipped to actors with a run (:func:`install`)."""
    return [entry for kind in KINDS for entry in _ENTRIES[kind].values() if not entry.builtin]


def install(shipped: Iterable[Entry]) -> None:
    """Register entries shipped from the driver, as they were registered there."""
    for entry in shipped:
        _ENTRIES[entry.kind][entry.name] = entry
