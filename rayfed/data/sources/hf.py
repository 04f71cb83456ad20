"""HuggingFace datasets, by hub name or ``save_to_disk`` folder, and ``datasets.Dataset`` objects a source returns."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from rayfed.data.sources.common import (_group_size, _require_no_options, _rows_of_sized_groups, _strings,
                                        one_row_per_group)
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.data.sources.hf_images import HFImages
from rayfed.errors import suggest
from rayfed.registry import register_source


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
    return _from_hf(loaded, request, f"'hf:{name}'")


def _from_hf(loaded: Any, request: SourceRequest, shown_as: str) -> ArrayDataset:
    """The columns of a ``datasets`` Dataset (or DatasetDict) that the config's ``*_column`` fields name, its images
    not decoded yet (:class:`~rayfed.data.sources.hf_images.HFImages`), after the rows ``data.one_per_group`` and
    the partition's group sizes keep.

    The image and label columns default to ``image`` and ``label`` and are read when present; a column set
    explicitly must exist."""
    import datasets

    config = request.config
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _split(loaded, config.split, shown_as)
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
    if config.one_per_group is not None:
        loaded = loaded.select(_one_per_group(loaded, config.one_per_group, shown_as))
    group_size = _group_size(config)
    if group_column is not None and group_size != (1, None):
        loaded = loaded.select(_rows_of_sized_groups(np.asarray(loaded[group_column]), group_size))
    images = image_counts = None
    if "image" in chosen:
        images = HFImages.of(loaded, chosen["image"], request.resize)
        image_counts = images.counts
    labels, class_names = None, ()
    if "label" in chosen:
        labels, class_names = _encode_labels(loaded[chosen["label"]], loaded.features[chosen["label"]], chosen["label"])
    text_columns = {role: _strings(loaded[chosen[role]]) for role in ("text", "target") if role in chosen}
    choices = None
    if "choices" in chosen:
        rows = [list(options) for options in loaded[chosen["choices"]]]
        if len({len(options) for options in rows}) > 1:
            raise DataError(f"data.choices_column = {chosen['choices']!r} holds questions with different numbers "
                            "of options; every question needs the same number.")
        choices = np.asarray([[str(option) for option in options] for options in rows], dtype=object)
    groups = np.asarray(loaded[group_column]) if group_column is not None else None
    return ArrayDataset(images, labels, class_names, groups, choices=choices, image_counts=image_counts,
                        **text_columns)

def _split(loaded: Any, split: str | None, shown_as: str) -> Any:
    """The rows of a DatasetDict that ``data.split`` names: a split, an expression such as ``train[:20%]+test``
    (as ``datasets.load_dataset`` reads it), or all splits (unset)."""
    import datasets

    if split is None:
        return datasets.concatenate_datasets(list(loaded.values()))
    if split in loaded:
        return loaded[split]
    try:
        parts = datasets.ReadInstruction.from_spec(split).to_absolute(
            {name: len(rows) for name, rows in loaded.items()})
    except (ValueError, AssertionError):
        raise DataError(f"data.split = {split!r} is not a split of {shown_as}{suggest(split, loaded)}; "
                        f"available: {', '.join(loaded)} (or an expression such as 'train[:10%]+test').") from None
    return datasets.concatenate_datasets([loaded[part.splitname].select(range(part.from_, part.to)) for part in parts])


def _one_per_group(loaded: Any, setting: Any, shown_as: str) -> np.ndarray:
    """The rows ``data.one_per_group`` keeps: one for each value of its column, in the dataset's order."""
    group_columns = (setting.column,) if isinstance(setting.column, str) else setting.column
    for field_name, column in [*(("column", c) for c in group_columns), ("order_column", setting.order_column)]:
        if column is not None and column not in loaded.column_names:
            raise DataError(
                f"data.one_per_group.{field_name} = {column!r} is not a column of {shown_as}"
                f"{suggest(column, loaded.column_names)}; columns: {', '.join(loaded.column_names)}."
            )
    order = None if setting.order_column is None else np.asarray(loaded[setting.order_column])
    values = [np.unique(np.asarray(loaded[column]), return_inverse=True)[1].reshape(-1) for column in group_columns]
    groups = values[0] if len(values) == 1 else np.unique(np.stack(values, axis=1), axis=0, return_inverse=True)[1]
    return one_row_per_group(groups.reshape(-1), order, setting.pick)


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
