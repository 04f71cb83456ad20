"""What a model's walks keep: its modules of a type, its parameters by name, its tied tensors and how a mode switch
reaches its modules, each made once per model and made again only after a module, parameter or buffer is registered
into it. A large model (thousands of modules) would otherwise be walked at every task or adapter switch, every load of
a client's values, every teacher forward and every ``train()`` / ``eval()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import nn

# Count module registrations (attribute, add_module, ModuleDict / ModuleList items), and parameter and buffer
# registrations, into a module that some model's kept values (modules_of_type, mode_switch, the places of
# named_parameter_table and functional_forward) were made from, so that those are made again only after a model may
# have changed. Registrations elsewhere leave them valid: a model being built, or the ModuleList that a slice makes
# (HF's decoders run `self.layers[:n]` at every forward, which registers each layer into a new list).
# torch.func.functional_call swaps tensors into `_parameters` without a registration, and restores them.
_registrations = 0
_parameter_registrations = 0  # and buffer registrations
_walked: weakref.WeakSet[nn.Module] = weakref.WeakSet()


# Not while torch.compile traces a forward: what a forward registers goes into the modules it makes (a slice's
# ModuleList), never a walked one, and a traced test of the weak set guards on its members by position, which the
# garbage collector may remove before the guard is built (torch 2.14: "set index out of range").
def _count_registration(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    global _registrations
    if not torch.compiler.is_compiling() and module in _walked:
        _registrations += 1


def _count_parameter_registration(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    global _parameter_registrations
    if not torch.compiler.is_compiling() and module in _walked:
        _parameter_registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)
torch.nn.modules.module.register_module_parameter_registration_hook(_count_parameter_registration)
torch.nn.modules.module.register_module_buffer_registration_hook(_count_parameter_registration)

K = TypeVar("K")

# Each model's kept values by key, with the registration counts each was made at; weakly keyed, so the model stays as
# it was (its copies and pickles carry none of them) and a model's values go with it. A value never holds the model
# itself (a WeakKeyDictionary's values are strong: the model would never be freed), only modules below it.
_kept_values: weakref.WeakKeyDictionary[nn.Module, dict[object, tuple[tuple[int, int], object]]] = (
    weakref.WeakKeyDictionary())


def _kept(model: nn.Module, key: object, make: Callable[[list[nn.Module]], K], parameters: bool = False) -> K:
    """``make(the model's modules)``, kept for ``model`` under ``key`` until a module (with ``parameters``: or a
    parameter or buffer) is registered into one of its modules."""
    stamp = (_registrations, _parameter_registrations if parameters else 0)
    values = _kept_values.get(model)
    if values is None:
        values = _kept_values[model] = {}
    entry = values.get(key)
    if entry is None or entry[0] != stamp:
        modules = list(model.modules())
        _walked.update(modules)
        entry = values[key] = (stamp, make(modules))
    return entry[1]  # type: ignore[return-value]


def modules_of_type(model: nn.Module, types: tuple[type, ...]) -> list[nn.Module]:
    """``model``'s modules (itself included) that are instances of ``types``, in module order. The list is kept
    for the model and made again only after a module has been registered into a walked module: a large model's walk
    (thousands of modules) would otherwise run at every task or adapter switch, several times a training step."""
    below = _kept(model, types, lambda modules: [module for module in modules[1:] if isinstance(module, types)])
    return [model, *below] if isinstance(model, types) else below


# A tensor of a model: its name in the model, the module holding it (None: the model itself) and its name there.
Place = tuple[str, nn.Module | None, str]


def _places(model: nn.Module, tables: tuple[str, ...], remove_duplicate: bool) -> list[Place]:
    """Where the model's tensors in ``tables`` (``_parameters``, ``_buffers``) live, every name of each, named and in
    the order of ``named_parameters`` (then ``named_buffers``); a module reached by several paths is named once with
    ``remove_duplicate``."""
    return [(f"{prefix}.{attr}" if prefix else attr, None if module is model else module, attr) for table in tables
            for prefix, module in model.named_modules(remove_duplicate=remove_duplicate)
            for attr, tensor in getattr(module, table).items() if tensor is not None]


def _tensor_at(model: nn.Module, place: Place) -> torch.Tensor:
    _, module, attr = place
    module = model if module is None else module
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def named_parameter_table(model: nn.Module) -> dict[str, nn.Parameter]:
    """``dict(model.named_parameters())`` without the walk (it ran at every load of a client's values, every train call
    and evaluation): the places of the parameters are kept for the model until a module or a parameter is registered
    into it, and each is read where it lives (``nn.Module._apply`` may put a new one there without a registration, and
    untie it)."""
    places = _kept(model, "parameter_places", lambda _: _places(model, ("_parameters",), True), parameters=True)
    table: dict[str, nn.Parameter] = {}
    seen: set[torch.Tensor] = set()
    for place in places:
        tensor = _tensor_at(model, place)
        if tensor not in seen:  # a tied parameter under its first name, as named_parameters gives it
            seen.add(tensor)
            table[place[0]] = tensor
    return table


def functional_forward(model: nn.Module, values: Mapping[str, torch.Tensor], *args: object, **kwargs: object,
                       ) -> torch.Tensor:
    """``torch.func.functional_call(model, values, args, kwargs, strict=False)``: the model run with ``values`` in place
    of those parameters and buffers, a value given for a tied tensor standing for every name of it. The names tied
    together are looked up once for the model (kept until a registration; checked at each use, as ``nn.Module._apply``
    may untie them), not at every call: functional_call walks every parameter and buffer of the model for them."""

    def make(_: list[nn.Module]) -> dict[str, list[Place]]:
        groups: dict[torch.Tensor, list[Place]] = {}
        for place in _places(model, ("_parameters", "_buffers"), False):
            groups.setdefault(_tensor_at(model, place), []).append(place)
        return {name: group for group in groups.values() if len(group) > 1 for name, *_ in group}

    tied = _kept(model, "tied_places", make, parameters=True)
    if any(any(_tensor_at(model, place) is not _tensor_at(model, tied[name][0]) for place in tied[name])
           for name in values if name in tied):
        _kept_values[model].pop("tied_places")
        tied = _kept(model, "tied_places", make, parameters=True)
    given = dict(values)
    for name in [name for name in values if name in tied]:
        for other, *_ in tied[name]:
            if other in values and values[other] is not values[name]:
                raise ValueError(f"values for {name!r} and {other!r}, which are tied, differ; give one of them.")
            given[other] = values[name]
    return torch.func.functional_call(model, given, args, kwargs, tie_weights=False, strict=False)


def mode_switch(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """How ``model.train(mode)`` reaches the modules below it: those whose ``training`` flag ``nn.Module.train``
    would set (every module below ``model`` that no module with a ``train`` of its own covers), and the topmost
    submodules with a ``train`` of their own (an HF model's), whose ``train`` covers their part. ``model``'s own flag
    is its caller's to set."""

    def make(_: list[nn.Module]) -> tuple[list[nn.Module], list[nn.Module]]:
        flags: list[nn.Module] = []
        own: list[nn.Module] = []
        seen: set[int] = set()
        pending = [model]
        while pending:
            module = pending.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            if module is not model and type(module).train is not nn.Module.train:
                own.append(module)
                continue
            if module is not model:
                flags.append(module)
            pending.extend(reversed(list(module.children())))
        return flags, own

    return _kept(model, "mode_switch", make)
