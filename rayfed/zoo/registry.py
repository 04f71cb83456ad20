"""What a model family is: its recipe, how it is pretrained and evaluated, and how it is loaded."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

Metrics = dict[str, float]


@dataclass
class ZooModel:
    """A loaded model with what turns raw inputs into its inputs."""

    model: nn.Module
    tokenizer: Any | None = None  # text -> token ids (a transformers or open_clip tokenizer); None: vision only
    processor: Any | None = None  # images (+ text) -> model inputs (open_clip: its eval image transform)


@dataclass(frozen=True)
class BuildReport:
    before: Metrics  # the randomly initialized model of the same config and seed
    after: Metrics  # the pretrained model, reloaded from its folder through the family's loader
    params: int


@dataclass(frozen=True)
class Family:
    """One pretrainable model family.

    ``recipe`` holds everything that decides the result (config, data, steps, seed, a version number
    bumped when the code changes what it builds); its hash names the cache entry.
    """

    name: str
    stands_in_for: str
    objective: str
    recipe: Mapping[str, Any]
    build: Callable[[Path, Mapping[str, Any], Mapping[str, Path]], BuildReport]  # (folder, recipe, dependency folders)
    evaluate: Callable[[Path, Mapping[str, Any]], Metrics]  # metrics of the model saved in a folder
    load: Callable[[str], ZooModel]  # a hub name or local folder -> the model users fine-tune
    requires: tuple[str, ...] = ()  # families whose pretrained models this one starts from
    needs_gpu: bool = False  # a build takes minutes on a GPU and hours on a CPU
