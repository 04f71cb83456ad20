"""Heavy libraries imported on first use.

``transformers``, ``peft``, ``datasets`` and ``open_clip`` take seconds each to import (``transformers`` and ``peft``
about 12 s of CPU on a small 2-core machine). A process that never builds a model or reads a Hugging Face dataset (a
DriverActor of most runs) then never pays for them; one that does pays once, on first use.
"""

from __future__ import annotations

import importlib
from typing import Any


class DeferredModule:
    """Stands for the module ``name``: the first attribute read imports it; every read is forwarded to it."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"
