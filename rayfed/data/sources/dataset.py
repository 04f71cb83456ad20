"""An in-memory dataset of named columns, what a source is asked for, and the error bad data raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed.errors import ConfigError

if TYPE_CHECKING:
    from rayfed.config import DataConfig


class DataError(ConfigError):
    """Bad data input; the message is one sentence naming the field, the value and what is allowed."""


_COLUMNS = ("images", "image_counts", "labels", "groups", "text", "target", "choices")
IMAGE_DTYPES = (np.uint8, np.float32)  # pixels 0..255, or floats in [0, 1]


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """An in-memory dataset: named columns, one value per sample (any of them may be absent)."""

    # (N, H, W, C) uint8 pixels 0..255 or float32 in [0, 1]; with several images a sample (N, K, H, W, C), each
    # sample's first image_counts[i] images filled and the rest zero
    images: np.ndarray | None = None
    labels: np.ndarray | None = None  # int64, (N,), values in 0..num_classes-1
    class_names: tuple[str, ...] = ()
    groups: np.ndarray | None = None  # (N,) natural group id per sample, for the `natural` partitioner
    text: np.ndarray | None = None  # (N,) input text: a question, caption or prompt
    target: np.ndarray | None = None  # (N,) output text: an answer or description
    choices: np.ndarray | None = None  # (N, K) the options of a multiple-choice question; labels index them
    domains: tuple[str, ...] = field(default=())  # names of the group ids, where they have names
    image_counts: np.ndarray | None = None  # int64, (N,): the images of each sample, where a sample has several

    def __post_init__(self) -> None:
        present = {name: getattr(self, name) for name in _COLUMNS if getattr(self, name) is not None}
        if not present:
            raise ValueError("a dataset needs at least one column (images, labels, text, target or choices)")
        size = len(next(iter(present.values())))
        for name, column in present.items():
            if len(column) != size:
                raise ValueError(f"column {name} has {len(column)} values but the dataset has {size} samples")
        if self.images is not None:
            _check_images(self.images, self.image_counts)
        elif self.image_counts is not None:
            raise ValueError("image_counts is set but there are no images")
        if self.labels is not None and (self.labels.ndim != 1 or self.labels.dtype != np.int64):
            raise ValueError(f"labels must be int64 (N,), got {self.labels.dtype} {self.labels.shape}")
        if self.choices is not None and self.choices.ndim != 2:
            raise ValueError(f"choices must be (N, K), got shape {self.choices.shape}")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(next(getattr(self, name) for name in _COLUMNS if getattr(self, name) is not None))

    @property
    def strata(self) -> np.ndarray:
        """What train/test splits stratify by: the labels where there are any, else one stratum."""
        return self.labels if self.labels is not None else np.zeros(len(self), dtype=np.int64)

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        """The samples at ``indices``, in that order."""
        columns = {name: getattr(self, name)[indices] for name in _COLUMNS if getattr(self, name) is not None}
        return ArrayDataset(**columns, class_names=self.class_names, domains=self.domains)


def _check_images(images: np.ndarray, counts: np.ndarray | None) -> None:
    if images.dtype not in IMAGE_DTYPES or images.ndim != (4 if counts is None else 5):
        raise ValueError(f"images must be uint8 or float32 (N, H, W, C), or (N, K, H, W, C) with image_counts, got "
                         f"{images.dtype} {images.shape}{'' if counts is None else ' with image_counts'}")
    if counts is not None and (counts.ndim != 1 or counts.dtype != np.int64 or counts.min(initial=0) < 0
                               or counts.max(initial=0) > images.shape[1]):
        raise ValueError(f"image_counts must be int64 (N,) in 0..{images.shape[1]}, got {counts.dtype} {counts.shape}")


@dataclass(frozen=True)
class SourceRequest:
    """What a source is asked for: the run's data config, its seed, a prefix source's argument (``cifar10``
    for ``hf:cifar10``) and its options (``data.options``)."""

    config: DataConfig
    seed: int
    argument: str | None = None

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.config.options or {})

    @property
    def name(self) -> str:
        source = self.config.source
        return source if isinstance(source, str) else getattr(source, "__name__", repr(source))
