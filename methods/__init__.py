"""The built-in PFL methods, one module each, and one package per seed paper; each registers its plug-ins by name
(``rayfed.register_method``).

The registry imports them from the one list of plug-in modules (pyproject.toml's ``rayfed.plugins`` entry points;
see :mod:`rayfed.registry`); configs name them (``methods: [fedavg, ditto]``), and the engine never imports a method
itself. A method of one's own may start from a built-in one: ``from rayfed.methods import Ditto, DittoParams`` and
subclass it: every built-in method class and its Params class import from here, found among the registered methods.
"""

from __future__ import annotations

from typing import Any


def _built_in_classes() -> dict[str, type]:
    """Every built-in method class and its Params class (but the shared empty one), by class name."""
    from rayfed import registry
    from rayfed.method import NoParams

    found: dict[str, type] = {}
    for entry in registry.entries("method"):
        if entry.builtin and isinstance(entry.obj, type):
            found[entry.obj.__name__] = entry.obj
            if entry.obj.Params is not NoParams:
                found[entry.obj.Params.__name__] = entry.obj.Params
    return found


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted(_built_in_classes())
    if not name.startswith("__") and (found := _built_in_classes().get(name)) is not None:
        return found
    raise AttributeError(f"module 'rayfed.methods' has no attribute {name!r}")
