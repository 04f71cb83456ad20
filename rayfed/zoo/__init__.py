"""Offline foundation models.

- :func:`load` loads what a method fine-tunes: ``tiny-pretrained:<family>``, ``hf:<hub name or folder>``
  or ``open_clip:<architecture>`` (with ``pretrained=`` a tag or checkpoint file).
- :func:`pretrained` returns the folder of a tiny model of a family (:data:`FAMILIES`) pretrained on
  synthetic data: the one shipped with rayfed (``rayfed/zoo/weights``) or one built on first use under
  :func:`cache_root`.
"""

from rayfed.zoo.cache import (
    build_all, cache_root, default_families, evaluate, pretrained, read_manifest, recipe, recipe_hash, ship, shipped,
)
from rayfed.zoo.families import FAMILIES
from rayfed.zoo.loading import MODEL_NAMES, load
from rayfed.zoo.registry import ZooModel

__all__ = [
    "FAMILIES",
    "MODEL_NAMES",
    "ZooModel",
    "build_all",
    "cache_root",
    "default_families",
    "evaluate",
    "load",
    "pretrained",
    "read_manifest",
    "recipe",
    "recipe_hash",
    "ship",
    "shipped",
]
