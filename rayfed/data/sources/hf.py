"""HuggingFace datasets, by hub name or ``save_to_disk`` folder, and ``datasets.Dataset`` objects a source returns."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed.data.sources.common import _group_size, _require_no_options, _rows_of_sized_groups, _strings
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.data.sources.images import Resize, decode_images
from rayfed.errors import suggest
from rayfed.registry import register_source

if TYPE_CHECKING:
    from rayfed.config import DataConfig


_CHUNK = 256  # rows read from the table at a time while decoding


@dataclass(frozen=True, eq=False)
class HFImages:
    """The image column of a ``datasets`` Dataset before decoding: the rows ``rows`` of ``table`` (that column alone,
    images stored undecoded); ``counts``: each row's number of images, where a row holds a list of them."""

    table: Any
    column: str
    decode_one: Any  # a stored value -> a PIL image (or the array it is)
    rows: np.ndarray
    counts: np.ndarray | None = None

    @classmethod
    def of(cls, loaded: Any, column: str) -> HFImages:
        import datasets

        feature = loaded.features[column]
        several = isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and isinstance(
            feature.feature, datasets.Image)
        image = feature.feature if several else feature
        table = loaded.select_columns([column])
        if not isinstance(image, datasets.Image):  # arrays: read as they are
            return cls(table, column, None, np.arange(len(table)))
        undecoded = datasets.Image(mode=image.mode, decode=False)
        table = table.cast_column(column, datasets.List(undecoded) if several else undecoded)
        counts = None
        if several:
            counts = np.concatenate([[len(value) for value in table[start:start + _CHUNK][column]]
                                     for start in range(0, len(table), _CHUNK)] or [[]]).astype(np.int64)
        return cls(table, column, image.decode_example, np.arange(len(table)), counts)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, indices: np.ndarray) -> HFImages:
        return dataclasses.replace(self, rows=self.rows[indices],
                                   counts=None if self.counts is None else self.counts[indices])

    def decode(self, resize: Resize) -> np.ndarray:
        """The rows' images, decoded one by one (:func:`~rayfed.data.sources.images.decode_images`)."""
        return decode_images(self._values, len(self.rows), self.column, resize, self.counts)

    def _values(self) -> Iterator[Any]:
        for start in range(0, len(self.rows), _CHUNK):
            for value in self.table[self.rows[start:start + _CHUNK].tolist()][self.column]:
                if value is None:
                    raise DataError(f"data.image_column = {self.column!r} has a sample without an image; drop such "
                                    "samples first (datasets' Dataset.filter).")
                if self.decode_one is None:
                    yield value
                elif self.counts is None:
                    yield self.decode_one(value)
                else:
                    yield [self.decode_one(image) for image in value]


def _is_hf_dataset(value: Any) -> bool:
    return type(value).__name__ in ("Dataset", "DatasetDict") and type(value).__module__.startswith("datasets")


@register_source("hf:")
def _hf(request: SourceRequest) -> ArrayDataset:
    """A HuggingFace dataset by hub name or ``save_to_disk`` folder; columns named by ``data.*_column``."""
    import datasets

    _require_no_options(request)
    config, name = request.config, request.argument or ""
    location = config.path if config.path is not None else name
    if not location:
        raise DataError("data.source = 'hf:' names no dataset; use 'hf:<hub name or save_to_disk folder>'.")
    if config.path is not None and not os.path.isdir(config.path):
        raise DataError(f"data.path = {config.path!r} is not a folder written by save_to_disk.")
    try:
        if os.path.isdir(location):
            loaded = datasets.load_from_disk(location)
        else:
            loaded = datasets.load_dataset(name, split=config.split or "train")
    except Exception as err:  # offline, unknown name, unreadable folder, ...: all reported the same way
        raise DataError(f"data.source = 'hf:{name}' could not be loaded ({type(err).__name__}: {err}).") from err
    return _from_hf(loaded, config, f"'hf:{name}'")


def _from_hf(loaded: Any, config: DataConfig, shown_as: str) -> ArrayDataset:
    """The columns of a ``datasets`` Dataset (or DatasetDict) that ``config``'s ``*_column`` fields name.

    The image and label columns default to ``image`` and ``label`` and are read when present; a column set
    explicitly must exist."""
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        split = config.split
        if split is None:
            loaded = datasets.concatenate_datasets(list(loaded.values()))
        elif split in loaded:
            loaded = loaded[split]
        else:
            raise DataError(
                f"data.split = {split!r} is not a split of {shown_as}{suggest(split, loaded)}; "
                f"available: {', '.join(loaded)}."
            )
    chosen: dict[str, str] = {}
    for role in ("image", "label", "text", "target", "choices"):
        field_name = f"{role}_column"
        column = getattr(config, field_name)
        explicit = field_name in config.model_fields_set or role in ("text", "target", "choices")
        if column is None or (column not in loaded.column_names and not explicit):
            continue
        if column not in loaded.column_names:
            raise DataError(
                f"data.{field_name} = {column!r} is not a column of {shown_as}{suggest(column, loaded.column_names)}; "
                f"columns: {', '.join(loaded.column_names)}."
            )
        chosen[role] = column
    group_column = config.partition.column
    if group_column is not None and group_column not in loaded.column_names:
        raise DataError(
            f"data.partition.column = {group_column!r} is not a column of {shown_as}"
            f"{suggest(group_column, loaded.column_names)}; columns: {', '.join(loaded.column_names)}."
        )
    for role, alternative in (("image", "text"), ("label", "target")):  # no inputs, or nothing to learn
        column = getattr(config, f"{role}_column")
        if role not in chosen and alternative not in chosen:
            raise DataError(
                f"data.{role}_column = {column!r} is not a column of {shown_as}"
                f"{suggest(str(column), loaded.column_names)}; columns: {', '.join(loaded.column_names)}."
            )
    group_size = _group_size(config)
    if group_column is not None and group_size != (1, None):
        loaded = loaded.select(_rows_of_sized_groups(np.asarray(loaded[group_column]), group_size))
    images = image_counts = None
    if "image" in chosen:
        column = HFImages.of(loaded, chosen["image"])
        images, image_counts = column.decode(config.resize), column.counts
    labels, class_names = None, ()
    if "label" in chosen:
        labels, class_names = _encode_labels(loaded[chosen["label"]], loaded.features[chosen["label"]], chosen["label"])
    text_columns = {role: _strings(loaded[chosen[role]]) for role in ("text", "target") if role in chosen}
    choices = None
    if "choices" in chosen:
        rows = [list(options) for options in loaded[chosen["choices"]]]
        if len({len(options) for options in rows}) > 1:
            raise DataError(f"data.choices_column = {chosen['choices']!r} holds questions with different numbers of options; "
                            "every question needs the same number.")
        choices = np.asarray([[str(option) for option in options] for options in rows], dtype=object)
    groups = np.asarray(loaded[group_column]) if group_column is not None else None
    return ArrayDataset(images, labels, class_names, groups, choices=choices, image_counts=image_counts,
                        **text_columns)

def _encode_labels(values: list[Any], feature: Any, label_column: str) -> tuple[np.ndarray, tuple[str, ...]]:
    """Labels as int64 0..K-1 plus class names: ClassLabel names if present, else sorted unique values."""
    import datasets

    raw = np.asarray(values)
    if isinstance(feature, datasets.ClassLabel):
        outside = raw[(raw < 0) | (raw >= feature.num_classes)]
        if outside.size:
            raise DataError(
                f"data.label_column = {label_column!r} has label {outside[0]} outside its "
                f"{feature.num_classes} classes (0..{feature.num_classes - 1}); drop unlabeled samples first."
            )
        return raw.astype(np.int64), tuple(feature.names)
    classes, codes = np.unique(raw, return_inverse=True)
    return codes.astype(np.int64).reshape(-1), tuple(str(c) for c in classes)
