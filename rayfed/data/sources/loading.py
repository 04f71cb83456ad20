"""Loading ``data.source`` into memory, and reading what a source returns as an :class:`ArrayDataset`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed.data.sources.common import _group_size, _rows_of_sized_groups, _strings
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.data.sources.hf import _from_hf, _hf, _is_hf_dataset
from rayfed.data.sources.memory import decode_within_memory
from rayfed.errors import suggest
from rayfed.registry import resolve

if TYPE_CHECKING:
    from rayfed.config import DataConfig
    from rayfed.models.image_processing import ImagePreprocessing

# Fixed stream ids: each random draw in rayfed.data.sources gets its own SeedSequence([seed, purpose]).
_PURPOSE_SUBSET = 1002


def load_source(config: DataConfig, seed: int = 0, decode: bool = True,
                image_processing: ImagePreprocessing | None = None, where: str = "data") -> ArrayDataset:
    """Load ``config.source``: then keep only samples of groups whose size is within the partition's bounds, and a
    seeded subset of ``max_samples`` samples. An hf dataset's images are decoded after that, for the samples kept
    only (with ``decode``; else they are left to decode, :meth:`ArrayDataset.decoded`), once their host memory is
    stated and found to fit (:func:`~rayfed.data.sources.memory.decode_within_memory`; ``where``: the config
    section, for its messages). ``image_processing``: the backbone's, for ``data.resize = 'backbone'``."""
    if config.max_samples is not None and config.max_samples <= 0:
        raise DataError(
            f"data.max_samples = {config.max_samples} is invalid: it must be > 0 (or unset for all samples)."
        )
    resolved = resolve("source", config.source)
    request = SourceRequest(config, seed, resolved.argument, image_processing)
    for field_name in ("resize", "one_per_group"):
        if getattr(config, field_name) is not None and resolved.obj is not _hf:
            raise DataError(f"data.{field_name} = {getattr(config, field_name)!r} is set but data.source = "
                            f"{resolved.name!r}; it only applies to hf: sources.")
    result = resolved.obj(request)
    if isinstance(result, ArrayDataset) and resolved.obj is not _hf and config.label_column != "label":
        raise DataError(
            f"data.label_column = {config.label_column!r} is set but data.source = {resolved.name!r} returns an "
            "ArrayDataset, whose labels are its own; data.label_column names a column of an hf: dataset or of a "
            "source's dict of columns."
        )
    dataset = as_dataset(result, request)
    group_column, group_size = config.partition.column, _group_size(config)
    if group_column is not None and dataset.groups is None:
        raise DataError(
            f"data.partition.column = {group_column!r} cannot be used with data.source = {resolved.name!r}: "
            "it has no such group column."
        )
    if group_column is not None and group_size != (1, None):  # (a datasets.Dataset is filtered before decoding)
        dataset = dataset.subset(_rows_of_sized_groups(dataset.groups, group_size))
    if config.max_samples is not None and config.max_samples < len(dataset):
        rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SUBSET]))
        dataset = dataset.subset(np.sort(rng.choice(len(dataset), size=config.max_samples, replace=False)))
    return decode_within_memory([(where, resolved.name, dataset)])[0] if decode else dataset

def as_dataset(result: Any, request: SourceRequest) -> ArrayDataset:
    """A source's return value as an :class:`ArrayDataset`; one sentence naming what is wrong with it."""
    if isinstance(result, ArrayDataset):
        return result
    if _is_hf_dataset(result):
        return _from_hf(result, request, f"data.source = {request.name!r}")
    if isinstance(result, tuple) and len(result) == 2:
        result = {"image": result[0], "label": result[1]}
    if not isinstance(result, Mapping):
        raise DataError(
            f"data.source = {request.name!r} returned a {type(result).__name__}; a source returns an ArrayDataset, "
            "a dict of columns (image, label, text, target, choices), an (images, labels) pair or a datasets.Dataset."
        )
    return _from_columns(dict(result), request)


def _from_columns(columns: dict[str, Any], request: SourceRequest) -> ArrayDataset:
    where = f"data.source = {request.name!r}"
    label_column = request.config.label_column
    if label_column != "label":  # the labels are in a column of another name, or (None) not read
        if label_column is not None and label_column not in columns:
            raise DataError(f"data.label_column = {label_column!r} is not a column {where} returned"
                            f"{suggest(label_column, columns)}; columns: {', '.join(sorted(columns))}.")
        labels = {} if label_column is None else {"label": columns[label_column]}
        columns = {**{n: v for n, v in columns.items() if n not in ("label", "labels", label_column)}, **labels}
    aliases = {"images": "image", "labels": "label"}
    columns = {aliases.get(name, name): value for name, value in columns.items()}
    group_column = request.config.partition.column
    known = {"image", "label", "text", "target", "choices", "class_names", "groups",
             *([group_column] if group_column else [])}
    unknown = sorted(set(columns) - known)
    if unknown:
        hint = "" if "label" in columns else f"; if it holds the labels, set data.label_column = {unknown[0]!r}"
        raise DataError(f"{where} returned a column {unknown[0]!r} rayfed does not read; columns it reads: "
                        f"{', '.join(sorted(known))}{hint}.")
    images = None
    if columns.get("image") is not None:
        images = _image_array(np.asarray(columns["image"]), f"{where} column 'image'")
    labels, class_names = None, tuple(str(name) for name in columns.get("class_names", ()))
    if columns.get("label") is not None:
        raw = np.asarray(columns["label"])
        if raw.ndim != 1:
            raise DataError(f"{where} returned labels of shape {raw.shape}; expected one label per sample, shape (N,).")
        if class_names and np.issubdtype(raw.dtype, np.integer):
            if raw.min() < 0 or raw.max() >= len(class_names):
                raise DataError(f"{where} returned a label outside its {len(class_names)} class_names.")
            labels = raw.astype(np.int64)
        else:
            found, codes = np.unique(raw, return_inverse=True)
            labels, class_names = codes.astype(np.int64).reshape(-1), tuple(str(c) for c in found)
    groups = columns.get(group_column) if group_column else columns.get("groups")
    try:
        return ArrayDataset(
            images, labels, class_names, None if groups is None else np.asarray(groups),
            text=_strings(columns.get("text")), target=_strings(columns.get("target")),
            choices=None if columns.get("choices") is None else np.asarray(columns["choices"], dtype=object),
        )
    except ValueError as err:
        raise DataError(f"{where} returned columns that do not fit together: {err}.") from None


def _image_array(pixels: np.ndarray, where: str) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) numbers -> (N, H, W, C): integers as uint8 pixels 0..255, floats as float32 in
    [0, 1]."""
    if pixels.ndim == 3:
        pixels = pixels[..., None]
    if pixels.ndim != 4 or not np.issubdtype(pixels.dtype, np.number):
        raise DataError(f"{where} holds {pixels.dtype} values of shape {pixels.shape}; "
                        "expected images (N, H, W, C) or (N, H, W).")
    integers = np.issubdtype(pixels.dtype, np.integer)
    if pixels.size and (pixels.min() < 0 or pixels.max() > (255 if integers else 1)):
        raise DataError(f"{where} has pixel values outside [0, 1]; give floats in [0, 1] or integers in 0..255.")
    return pixels.astype(np.uint8 if integers else np.float32, copy=False)
