"""Structured parameter names, parsed and formatted in one place, for the engine and the methods alike.

A model's parameter name is dotted (``encoder.model.layers.3.mlp.down_proj.local_A``): a decoder layer's parameters
carry ``layers.<i>`` (0-based), a task's own parameters a ``task_<i>`` component (its index in the run's task list),
and a named adapter's tensors end with ``<module>.<adapter>_<part>`` (:mod:`rayfed.models.peft.named_adapters`).
The server sees each name behind a prefix (``<prefix>/<name>``): its architecture's
(:func:`rayfed.architectures.prefixed`), a server slot's, or a checkpoint's client id.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

PREFIX_SEP = "/"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ADAPTER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.([^.]+)_([^._]+)$")
_ADAPTER_LEAF = re.compile(r"(.+)_([^._]+)")
_TASK_COMPONENT = re.compile(r"(?:^|\.)task_(\d+)(?:\.|$)")


# Dotted paths --------------------------------------------------------------------------------------------------
def leaf(name: str) -> str:
    """The last component of a dotted name (``q_proj`` of ``layers.0.q_proj``)."""
    return name.rpartition(".")[2]


def parent(name: str) -> str:
    """A dotted name without its last component (``""`` for a one-component name)."""
    return name.rpartition(".")[0]


def components(name: str) -> list[str]:
    """A dotted name's components, in order."""
    return name.split(".")


# Prefixes ------------------------------------------------------------------------------------------------------
def prefixed_name(prefix: str, name: str) -> str:
    """``name`` behind ``prefix``: ``<prefix>/<name>``."""
    return f"{prefix}{PREFIX_SEP}{name}"


def split_prefix(name: str) -> tuple[str, str]:
    """A prefixed name's prefix (up to its first ``/``) and the name behind it."""
    prefix, sep, rest = name.partition(PREFIX_SEP)
    if not sep:
        raise ValueError(f"the name {name!r} has no '<prefix>{PREFIX_SEP}' in front of it")
    return prefix, rest


def prefix_of(name: str) -> str | None:
    """A prefixed name's prefix, or None for a name without one."""
    prefix, sep, _ = name.partition(PREFIX_SEP)
    return prefix if sep else None


def behind(name: str, prefix: str) -> str | None:
    """The name behind ``prefix`` when ``name`` is ``<prefix>/<name>``, else None."""
    start = prefix + PREFIX_SEP
    return name[len(start):] if name.startswith(start) else None


# Tasks ---------------------------------------------------------------------------------------------------------
def task_key(index: int) -> str:
    """The name component that marks a parameter as task ``index``'s own."""
    return f"task_{index}"


@functools.lru_cache(maxsize=None)  # asked for every tensor of every payload, every round
def task_of_name(name: str) -> int | None:
    """The task a parameter belongs to (its ``task_<index>`` component), or None for a shared one."""
    match = _TASK_COMPONENT.search(name)
    return int(match.group(1)) if match else None


# Adapter sets (rayfed.models.peft.modules.add_adapter_set: ``...<site>.adapters.<set>.<tensor>``)
ADAPTER_SETS = "adapters"


def _adapter_set_index(parts: list[str]) -> int | None:
    return next((index + 1 for index, part in enumerate(parts[:-1]) if part == ADAPTER_SETS), None)


@functools.lru_cache(maxsize=None)  # methods ask it of every trained tensor, every step
def adapter_set_of(name: str) -> str | None:
    """The adapter set a tensor belongs to (the component after ``adapters``), or None."""
    parts = components(name)
    index = _adapter_set_index(parts)
    return None if index is None else parts[index]


def with_adapter_set(name: str, adapter_set: str) -> str:
    """An adapter set's tensor ``name`` renamed to the same tensor of ``adapter_set`` at the same site."""
    parts = components(name)
    index = _adapter_set_index(parts)
    if index is None:
        raise ValueError(f"the name {name!r} has no '{ADAPTER_SETS}.<set>' component")
    return ".".join([*parts[:index], adapter_set, *parts[index + 1:]])


# Decoder layers and named adapters -----------------------------------------------------------------------------
class AdapterTensor(NamedTuple):
    """One named adapter's tensor in a decoder layer: ``...layers.<layer>.<module>.<adapter>_<part>``."""

    layer: int
    module: str
    adapter: str
    part: str


def layer_of(name: str) -> int | None:
    """The 0-based decoder layer index in a parameter name (``...layers.<i>.``), or None."""
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def adapter_param(adapter: str, part: str) -> str:
    """The attribute name of named adapter ``adapter``'s tensor ``part`` on its layer: ``<adapter>_<part>``."""
    return f"{adapter}_{part}"


@functools.lru_cache(maxsize=None)  # methods ask it of every trained tensor, every step
def adapter_part(name: str) -> tuple[str, str] | None:
    """The adapter and part a tensor's last component names (``("local", "P")`` of ``...q_proj.local_P``), or None."""
    match = _ADAPTER_LEAF.fullmatch(leaf(name))
    return None if match is None else (match.group(1), match.group(2))


def adapter_of(name: str) -> str | None:
    """The named adapter a tensor belongs to (``local`` of ``...q_proj.local_P``), or None."""
    parsed = adapter_part(name)
    return None if parsed is None else parsed[0]


def with_adapter(name: str, adapter: str) -> str:
    """A named adapter's tensor ``name`` renamed to the same part of ``adapter`` on the same module."""
    parsed = adapter_part(name)
    if parsed is None:
        raise ValueError(f"the name {name!r} does not end with '<adapter>_<part>'")
    module = parent(name)
    return f"{module}.{adapter_param(adapter, parsed[1])}" if module else adapter_param(adapter, parsed[1])


def adapter_tensor(name: str) -> AdapterTensor | None:
    """What a named adapter's tensor in a decoder layer is (its layer, module, adapter and part), or None."""
    match = _ADAPTER.search(name)
    return None if match is None else AdapterTensor(int(match.group(1)), *match.group(2, 3, 4))
