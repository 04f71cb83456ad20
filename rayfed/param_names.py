"""Structured parameter names, parsed in one place.

A model's parameter name is dotted (``encoder.model.layers.3.mlp.down_proj.local_A``): a decoder layer's parameters
carry ``layers.<i>`` (0-based), and a named adapter's tensors end with ``<module>.<adapter>_<part>``
(:mod:`rayfed.models.peft.named_adapters`). The server sees each name behind its architecture's prefix
(``<architecture>/<name>``, :func:`rayfed.architectures.prefixed`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ADAPTER = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.([^.]+)_([^._]+)$")


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


def adapter_tensor(name: str) -> AdapterTensor | None:
    """What a named adapter's tensor in a decoder layer is (its layer, module, adapter and part), or None."""
    match = _ADAPTER.search(name)
    return None if match is None else AdapterTensor(int(match.group(1)), *match.group(2, 3, 4))

