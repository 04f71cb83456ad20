"""HuggingFace datasets, by hub name or ``save_to_disk`` folder, and ``datasets.Dataset`` objects a source returns."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed.data.sources.common import _group_size, _require_no_options, _rows_of_sized_groups, _strings
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.errors import suggest
from rayfed.registry import register_source

if TYPE_CHECKING:
    from rayfed.config import DataConfig


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
    images = _stack_images(loaded[chosen["image"]], chosen["image"], config.resize) if "image" in chosen else None
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
    return ArrayDataset(images, labels, class_names, groups, choices=choices, **text_columns)

def _stack_images(column: list[Any], image_column: str, resize: int | None = None) -> np.ndarray:
    """PIL images or nested arrays -> float32 (N, H, W, C) in [0, 1]; sizes must already agree.

    Integer pixels, and float pixels when any exceeds 1, are read as 0..255; other floats as 0..1.
    """
    arrays = [_image_to_hwc(image, image_column, resize) for image in column]
    shapes = sorted({a.shape for a in arrays})
    if len(shapes) > 1:
        raise DataError(
            f"data.image_column = {image_column!r} holds images of {len(shapes)} different shapes "
            f"(e.g. {shapes[0]} and {shapes[-1]}); all images must have the same size."
        )
    if not arrays:
        raise DataError(f"data.image_column = {image_column!r} is empty; the dataset has no samples.")
    pixels = np.stack(arrays)
    if np.issubdtype(pixels.dtype, np.integer) or pixels.max() > 1:
        pixels = pixels / 255.0
    if pixels.min() < 0 or pixels.max() > 1:
        raise DataError(
            f"data.image_column = {image_column!r} has pixel values outside 0..255 (or 0..1 for floats)."
        )
    return pixels.astype(np.float32)


def _image_to_hwc(image: Any, image_column: str, resize: int | None = None) -> np.ndarray:
    """One PIL image or array -> numeric (H, W, C); grayscale keeps C = 1 unless resized (then RGB)."""
    from PIL import Image

    if resize is not None:
        image = Image.fromarray(np.asarray(image)) if not isinstance(image, Image.Image) else image
        image = image.convert("RGB").resize((resize, resize), Image.Resampling.BICUBIC)
    if isinstance(image, Image.Image) and image.mode not in ("L", "RGB"):
        image = image.convert("L" if image.mode in ("1", "LA") else "RGB")
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[..., None]
    if array.ndim != 3 or not np.issubdtype(array.dtype, np.number):
        raise DataError(
            f"data.image_column = {image_column!r} holds a {array.dtype} value of shape {array.shape}; "
            f"expected images of shape (H, W) or (H, W, C)."
        )
    return array


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
