"""Datasets loaded into memory, from the built-in sources or a user's own (``data.source``).

Every source yields an :class:`ArrayDataset` of named columns, each one value per sample: float32
images (N, H, W, C) in [0, 1], int64 labels 0..K-1 with their class names, input ``text``, output
``target`` text, the ``choices`` of a multiple-choice question, and, where the data has them, natural
per-sample ``groups`` (writers, render styles, question types) for the partitioners.

A source is a plug-in (:mod:`rayfed.registry`): a function ``source(request: SourceRequest)`` returning
an :class:`ArrayDataset`, a dict of columns (``image``, ``label``, ``text``, ``target``, ``choices``,
``class_names``, and the ``data.partition.column`` if any), an ``(images, labels)`` pair, or a
``datasets.Dataset`` (read with ``data.*_column``).
"""

from __future__ import annotations

import gzip
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rayfed.errors import ConfigError, suggest
from rayfed.registry import register_source, resolve

if TYPE_CHECKING:
    from rayfed.config import DataConfig

FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_IDX_UBYTE = 0x08

_SYNTHETIC_DEFAULTS: dict[str, float | int] = {
    "num_samples": 600,
    "num_classes": 10,
    "image_size": 8,
    "channels": 1,
    "noise": 0.3,
    "num_writers": 30,
}
SYNTHETIC_GROUP_COLUMN = "writer"  # the synthetic source's natural groups
_SYNTHETIC_TEXT_DEFAULTS: dict[str, int] = {"num_samples": 600, "prompt_words": 32, "target_words": 8}
_SHAPES_DEFAULTS: dict[str, Any] = {"num_samples": 4800, "styles": ["noisy"], "image_size": 32}
_PARTS_DEFAULTS: dict[str, Any] = {"num_samples": 6000, "label_space": "fine", "world": 0, "noise": 0.1}
SHAPES_GROUP_COLUMN = "domain"  # the shapes source's natural groups: render styles
_WRITER_STYLE_SCALE = 0.15

# Fixed stream ids: each random draw in this module gets its own SeedSequence([seed, purpose]).
_PURPOSE_SYNTHETIC = 1001
_PURPOSE_SUBSET = 1002
_PURPOSE_SYNTHETIC_TEXT = 1005


class DataError(ConfigError):
    """Bad data input; the message is one sentence naming the field, the value and what is allowed."""


_COLUMNS = ("images", "labels", "groups", "text", "target", "choices")


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """An in-memory dataset: named columns, one value per sample (any of them may be absent)."""

    images: np.ndarray | None = None  # float32, (N, H, W, C), values in [0, 1]
    labels: np.ndarray | None = None  # int64, (N,), values in 0..num_classes-1
    class_names: tuple[str, ...] = ()
    groups: np.ndarray | None = None  # (N,) natural group id per sample, for the `natural` partitioner
    text: np.ndarray | None = None  # (N,) input text: a question, caption or prompt
    target: np.ndarray | None = None  # (N,) output text: an answer or description
    choices: np.ndarray | None = None  # (N, K) the options of a multiple-choice question; labels index them
    domains: tuple[str, ...] = field(default=())  # names of the group ids, where they have names

    def __post_init__(self) -> None:
        present = {name: getattr(self, name) for name in _COLUMNS if getattr(self, name) is not None}
        if not present:
            raise ValueError("a dataset needs at least one column (images, labels, text, target or choices)")
        size = len(next(iter(present.values())))
        for name, column in present.items():
            if len(column) != size:
                raise ValueError(f"column {name} has {len(column)} values but the dataset has {size} samples")
        if self.images is not None and (self.images.ndim != 4 or self.images.dtype != np.float32):
            raise ValueError(f"images must be float32 (N, H, W, C), got {self.images.dtype} {self.images.shape}")
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


def load_source(config: DataConfig, seed: int = 0) -> ArrayDataset:
    """Load ``config.source`` into memory: then keep only samples of groups whose size is within the
    partition's bounds, and a seeded subset of ``max_samples`` samples."""
    if config.max_samples is not None and config.max_samples <= 0:
        raise DataError(f"data.max_samples = {config.max_samples} is invalid: it must be > 0 (or unset for all samples).")
    resolved = resolve("source", config.source)
    request = SourceRequest(config, seed, resolved.argument)
    if config.resize is not None and resolved.obj is not _hf:
        raise DataError(f"data.resize = {config.resize} is set but data.source = {resolved.name!r}; it only applies to hf: sources.")
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
    return dataset


def _group_size(config: DataConfig) -> tuple[int, int | None]:
    partition = config.partition
    return (1, None) if partition.max_group_size is None else (partition.min_samples, partition.max_group_size)


def as_dataset(result: Any, request: SourceRequest) -> ArrayDataset:
    """A source's return value as an :class:`ArrayDataset`; one sentence naming what is wrong with it."""
    if isinstance(result, ArrayDataset):
        return result
    if _is_hf_dataset(result):
        return _from_hf(result, request.config, f"data.source = {request.name!r}")
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
    known = {"image", "label", "text", "target", "choices", "class_names", "groups", *([group_column] if group_column else [])}
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


def _strings(values: Any) -> np.ndarray | None:
    return None if values is None else np.asarray([str(v) for v in values], dtype=object)


def _image_array(pixels: np.ndarray, where: str) -> np.ndarray:
    """(N, H, W) or (N, H, W, C) numbers -> float32 (N, H, W, C) in [0, 1] (integers are read as 0..255)."""
    if pixels.ndim == 3:
        pixels = pixels[..., None]
    if pixels.ndim != 4 or not np.issubdtype(pixels.dtype, np.number):
        raise DataError(f"{where} holds {pixels.dtype} values of shape {pixels.shape}; expected images (N, H, W, C) or (N, H, W).")
    if np.issubdtype(pixels.dtype, np.integer):
        pixels = pixels / 255.0
    if pixels.size and (pixels.min() < 0 or pixels.max() > 1):
        raise DataError(f"{where} has pixel values outside [0, 1]; give floats in [0, 1] or integers in 0..255.")
    return pixels.astype(np.float32)


def _require_no_split(source: str, split: str | None) -> None:
    if split is not None:
        raise DataError(f"data.split = {split!r} is not supported for source {source!r}: it has a single split.")


def _require_group_column(source: str, group_column: str | None, only: str) -> None:
    if group_column not in (None, only):
        raise DataError(
            f"data.partition.column = {group_column!r} is not a column of {source!r}; its only group column is {only!r}."
        )


def _require_no_group_column(source: str, group_column: str | None) -> None:
    if group_column is not None:
        raise DataError(
            f"data.partition.column = {group_column!r} cannot be used with source {source!r}: it has no group column."
        )


def _require_no_options(request: SourceRequest) -> None:
    if request.config.options is not None:
        raise DataError(
            f"data.options is set but data.source = {request.name!r} takes no options; they apply to generators "
            "(synthetic, shapes, parts, multimodal:<task>) and user sources."
        )


@register_source("sklearn:digits")
def _load_digits(request: SourceRequest) -> ArrayDataset:
    """scikit-learn's 1,797 8x8 handwritten digits, 10 classes."""
    from sklearn.datasets import load_digits

    _require_no_options(request)
    _require_no_split(request.name, request.config.split)
    _require_no_group_column(request.name, request.config.partition.column)
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return ArrayDataset(images, digits.target.astype(np.int64), tuple(str(d) for d in range(10)))


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST from IDX files


@register_source("fashion_mnist")
def _load_fashion_mnist(request: SourceRequest) -> ArrayDataset:
    """Fashion-MNIST (70,000 28x28 images, 10 classes) from IDX files, Debian's dataset-fashion-mnist by default."""
    _require_no_options(request)
    _require_no_group_column(request.name, request.config.partition.column)
    path, split = request.config.path, request.config.split
    if split not in (None, "train", "test"):
        raise DataError(
            f"data.split = {split!r} is not a Fashion-MNIST split; use 'train', 'test' or leave it unset for both."
        )
    folder = Path(path if path is not None else FASHION_MNIST_DEFAULT_DIR)
    splits = [split] if split is not None else ["train", "test"]
    needed = [folder / name for s in splits for name in _FASHION_MNIST_FILES[s]]
    if not all(f.is_file() for f in needed):
        field_name = "data.path" if path is not None else "data.path (unset, default)"
        raise DataError(
            f"{field_name}: '{folder}' has no Fashion-MNIST IDX files ({', '.join(f.name for f in needed)}); "
            f"install Debian's dataset-fashion-mnist, point data.path at a folder that has them, "
            f"or use data.source 'hf:fashion_mnist'."
        )
    images, labels = [], []
    for s in splits:
        image_file, label_file = _FASHION_MNIST_FILES[s]
        split_images = _read_idx(folder / image_file, ndim=3)
        split_labels = _read_idx(folder / label_file, ndim=1)
        if len(split_images) != len(split_labels):
            raise DataError(
                f"data.path: '{folder / image_file}' has {len(split_images)} images but "
                f"'{label_file}' has {len(split_labels)} labels; they must match."
            )
        images.append(split_images)
        labels.append(split_labels)
    pixels = np.concatenate(images).astype(np.float32) / 255.0
    return ArrayDataset(pixels[..., None], np.concatenate(labels).astype(np.int64), FASHION_MNIST_CLASSES)


def _read_idx(file: Path, ndim: int) -> np.ndarray:
    """Parse a gzip-compressed IDX file of unsigned bytes with ``ndim`` dimensions."""
    with gzip.open(file, "rb") as stream:
        raw = stream.read()
    if len(raw) < 4 or raw[:2] != b"\0\0" or raw[2] != _IDX_UBYTE or raw[3] != ndim:
        raise DataError(f"data.path: '{file}' is not an IDX file of unsigned bytes with {ndim} dimension(s).")
    header_size = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", raw[4:header_size])
    if len(raw) - header_size != int(np.prod(shape)):
        raise DataError(f"data.path: '{file}' is truncated or corrupt (header says shape {shape}).")
    return np.frombuffer(raw, dtype=np.uint8, offset=header_size).reshape(shape)


# ---------------------------------------------------------------------------------------------
# HuggingFace datasets


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


def _rows_of_sized_groups(groups: np.ndarray, group_size: tuple[int, int | None]) -> np.ndarray:
    """Indices of the samples whose group has between ``group_size[0]`` and ``group_size[1]`` samples."""
    smallest, largest = group_size
    _, inverse, counts = np.unique(groups, return_inverse=True, return_counts=True)
    sizes = counts[inverse.reshape(-1)]
    return np.flatnonzero((sizes >= smallest) & (sizes <= (largest if largest is not None else sizes.max())))


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


# ---------------------------------------------------------------------------------------------
# Synthetic data


def generator_options(
    options: dict[str, Any], defaults: dict[str, Any], source_note: str, positive_ints: tuple[str, ...]
) -> dict[str, Any]:
    """``data.options`` over a generator's defaults; unknown keys and non-positive counts are errors."""
    unknown = [key for key in options if key not in defaults]
    if unknown:
        raise DataError(
            f"data.options has no option {unknown[0]!r}{suggest(unknown[0], defaults)}{source_note}; "
            f"allowed: {', '.join(defaults)}."
        )
    params = {**defaults, **options}
    for key in positive_ints:
        if not isinstance(params[key], int) or isinstance(params[key], bool) or params[key] < 1:
            raise DataError(f"data.options.{key} = {params[key]!r} is invalid: it must be an integer >= 1.")
    return params


def non_negative(params: dict[str, Any], key: str) -> float:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise DataError(f"data.options.{key} = {value!r} is invalid: it must be a number >= 0.")
    return value


@register_source("synthetic")
def _make_synthetic(request: SourceRequest) -> ArrayDataset:
    """Class prototypes + per-writer style offset + Gaussian noise, clipped to [0, 1]; groups = writers."""
    _require_no_split(request.name, request.config.split)
    _require_group_column(request.name, request.config.partition.column, SYNTHETIC_GROUP_COLUMN)
    params = generator_options(
        request.options, _SYNTHETIC_DEFAULTS, "", ("num_samples", "num_classes", "image_size", "channels", "num_writers")
    )
    noise = non_negative(params, "noise")

    num_samples, num_classes, num_writers = params["num_samples"], params["num_classes"], params["num_writers"]
    image_shape = (params["image_size"], params["image_size"], params["channels"])
    rng = np.random.default_rng(np.random.SeedSequence([request.seed, _PURPOSE_SYNTHETIC]))
    prototypes = rng.uniform(0.0, 1.0, size=(num_classes, *image_shape))
    writer_styles = rng.normal(0.0, _WRITER_STYLE_SCALE, size=(num_writers, *image_shape))
    labels = rng.permutation(np.arange(num_samples) % num_classes)
    writers = rng.permutation(np.arange(num_samples) % num_writers)
    pixels = prototypes[labels] + writer_styles[writers] + rng.normal(0.0, noise, size=(num_samples, *image_shape))
    images = np.clip(pixels, 0.0, 1.0).astype(np.float32)
    class_names = tuple(f"class_{k}" for k in range(num_classes))
    return ArrayDataset(images, labels.astype(np.int64), class_names, writers.astype(np.int64))


@register_source("synthetic-text")
def _make_synthetic_text(request: SourceRequest) -> ArrayDataset:
    """Text generation of an exact length: a prompt of ``prompt_words`` random words of the offline vocabulary,
    its target the prompt's first ``target_words`` words (a copy task); one token per word for the word
    tokenizer of ``tiny-pretrained:`` and ``llama:`` backbones."""
    from rayfed.data.multimodal import vocabulary

    _require_no_split(request.name, request.config.split)
    _require_no_group_column(request.name, request.config.partition.column)
    params = generator_options(request.options, _SYNTHETIC_TEXT_DEFAULTS, " for 'synthetic-text'",
                               tuple(_SYNTHETIC_TEXT_DEFAULTS))
    if params["target_words"] > params["prompt_words"]:
        raise DataError(f"data.options.target_words = {params['target_words']} is more than prompt_words = "
                        f"{params['prompt_words']}; the target copies the prompt's first words.")
    words = np.asarray([word for word in vocabulary() if word.isalpha()], dtype=object)
    rng = np.random.default_rng(np.random.SeedSequence([request.seed, _PURPOSE_SYNTHETIC_TEXT]))
    prompts = words[rng.integers(0, len(words), size=(params["num_samples"], params["prompt_words"]))]
    return ArrayDataset(text=np.asarray([" ".join(row) for row in prompts], dtype=object),
                        target=np.asarray([" ".join(row[:params["target_words"]]) for row in prompts], dtype=object))


@register_source("shapes")
def _make_shapes(request: SourceRequest) -> ArrayDataset:
    """The 64 "{colour} {shape}" classes rendered in ``styles`` (:mod:`rayfed.data.multimodal`); groups = style.

    Class ids put the 32 classes with an even (shape + colour) index first, so that the first half (the
    base classes of a base-to-novel split) and the second half each hold every colour and every shape.
    """
    from rayfed.data import multimodal

    _require_no_split(request.name, request.config.split)
    _require_group_column(request.name, request.config.partition.column, SHAPES_GROUP_COLUMN)
    params = generator_options(request.options, _SHAPES_DEFAULTS, " for 'shapes'", ("num_samples", "image_size"))
    distribution = multimodal.Distribution(multimodal.CLASSES, tuple(params["styles"]), ("shapes",))
    columns = multimodal.shape_columns(params["num_samples"], seed=request.seed, distribution=distribution,
                                       image_size=params["image_size"])  # fmt: skip
    order = sorted(range(len(multimodal.CLASSES)), key=lambda k: ((k // 8 + k % 8) % 2, k))
    class_names = tuple(multimodal.CLASSES[k] for k in order)
    labels = np.asarray([class_names.index(name) for name in columns["class_name"]], dtype=np.int64)
    styles = np.asarray([multimodal.STYLES.index(name) for name in columns["domain"]], dtype=np.int64)
    return ArrayDataset(columns["image"].astype(np.float32) / 255.0, labels, class_names, styles)


@register_source("parts")
def _make_parts(request: SourceRequest) -> ArrayDataset:
    """Part-texture layouts (:mod:`rayfed.data.parts`) in one of its label spaces; the world is fixed by
    ``world``, the samples by the run's seed."""
    from rayfed.data import parts

    _require_no_split(request.name, request.config.split)
    _require_no_group_column(request.name, request.config.partition.column)
    params = generator_options(request.options, _PARTS_DEFAULTS, " for 'parts'", ("num_samples",))
    if params["label_space"] not in parts.LABEL_SPACES:
        raise DataError(
            f"data.options.label_space = {params['label_space']!r} is not known; allowed: {', '.join(parts.LABEL_SPACES)}."
        )
    if isinstance(params["world"], bool) or not isinstance(params["world"], int) or params["world"] < 0:
        raise DataError(f"data.options.world = {params['world']!r} is invalid: it must be an integer >= 0.")
    noise = non_negative(params, "noise")
    images, labels = parts.render(
        params["num_samples"], label_space=params["label_space"], seed=request.seed, world_seed=params["world"],
        noise=noise,
    )
    return ArrayDataset(images, labels, parts.class_names(params["label_space"]))


_MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "num_samples": 2000, "image_size": 32, "styles": None, "classes": None, "question_types": None,
    "subjects": None, "label_noise": 0.0, "scenes": 0, "scene_classes": 16, "wording": 0, "subsets": None,
}  # fmt: skip
MULTIMODAL_GROUP_COLUMNS = ("domain", "question_type", "scene", "shape", "color", "subset")
_SUBSET_OPTIONS = ("num_samples", "styles", "classes", "question_types", "wording")
_PURPOSE_SCENES = 1003
_PURPOSE_SUBSETS = 1004


@register_source("multimodal:")
def _make_multimodal(request: SourceRequest) -> ArrayDataset:
    """Synthetic multi-modal tasks (:mod:`rayfed.data.multimodal`): ``multimodal:vqa`` (image + question ->
    answer), ``shapes`` (image -> class, or its caption), ``topics`` (text -> topic), ``description``
    (concepts -> description), ``multiple-choice`` (question -> one of 4 options), ``statements`` (text).

    Group columns for the partitioners (heterogeneity): ``domain`` (render style, or a text task's topic
    or subject), ``question_type`` (VQA's function), ``scene`` (with ``scenes: N``: N scenes, each with its
    own background style and its own ``scene_classes`` object classes), ``shape``, ``color``, and ``subset``
    (VQA with ``subsets: [{styles, classes, question_types, wording, num_samples}, ...]``: one dataset per
    entry, e.g. one per client with its own visual style and question phrasing). ``wording: k`` asks VQA's
    image questions in their k-th other phrasing; ``question_types`` may add ``knowledge`` and ``arithmetic``.
    """
    from rayfed.data import multimodal

    task = request.argument or ""
    if task not in multimodal.TASKS:
        raise DataError(f"data.source = {request.name!r} names no generator{suggest(task, multimodal.TASKS)}; "
                        f"allowed: {', '.join('multimodal:' + t for t in multimodal.TASKS)}.")
    _require_no_split(request.name, request.config.split)
    group_column = request.config.partition.column
    if group_column is not None and group_column not in MULTIMODAL_GROUP_COLUMNS:
        raise DataError(f"data.partition.column = {group_column!r} is not a column of {request.name!r}"
                        f"{suggest(group_column, MULTIMODAL_GROUP_COLUMNS)}; allowed: {', '.join(MULTIMODAL_GROUP_COLUMNS)}.")
    params = generator_options(request.options, _MULTIMODAL_DEFAULTS, f" for {request.name!r}",
                               ("num_samples", "image_size", "scene_classes"))
    options = {key: tuple(params[key]) for key in ("question_types", "subjects") if params[key] is not None}
    if params["label_noise"]:
        options["label_noise"] = non_negative(params, "label_noise")
    if params["wording"]:
        _require_vqa(task, "wording")
        options["wording"] = params["wording"]
    classes = tuple(params["classes"] or multimodal.CLASSES)
    styles = tuple(params["styles"] or multimodal.FINETUNE_STYLES)
    try:
        if params["subsets"] is not None:
            if params["scenes"]:
                raise DataError("data.options.subsets and data.options.scenes are both set; keep one.")
            columns = _subsets(task, params["subsets"], params, classes, styles, request.seed, options)
        elif params["scenes"]:
            columns = _scenes(task, params, classes, styles, request.seed, options)
        else:
            if task in ("shapes", "vqa", "description"):
                options["distribution"] = multimodal.Distribution(classes, styles, (task,))
            columns = multimodal.columns(task, params["num_samples"], seed=request.seed,
                                         image_size=params["image_size"], **options)
    except ConfigError as err:  # the generators name their own arguments: point at data.options
        raise DataError(f"data.options.{str(err)}") from None
    return _multimodal_dataset(task, columns, group_column)


def _scenes(task: str, params: dict[str, Any], classes: tuple[str, ...], styles: tuple[str, ...], seed: int,
            options: dict[str, Any]) -> dict[str, Any]:
    """``scenes`` image datasets, each from its own background style and subset of classes, concatenated."""
    from rayfed.data import multimodal

    if task not in ("shapes", "vqa"):
        raise DataError(f"data.options.scenes applies to image tasks (multimodal:shapes, multimodal:vqa), not {task!r}.")
    scenes, per_scene = int(params["scenes"]), params["scene_classes"]
    if per_scene > len(classes):
        raise DataError(f"data.options.scene_classes = {per_scene} is more than the {len(classes)} classes.")
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SCENES]))
    parts = []
    for scene, count in enumerate(np.array_split(np.arange(params["num_samples"]), scenes)):
        chosen = tuple(classes[k] for k in np.sort(rng.choice(len(classes), per_scene, replace=False)))
        distribution = multimodal.Distribution(chosen, (styles[scene % len(styles)],), (task,))
        scene_seed = int(np.random.SeedSequence([seed, _PURPOSE_SCENES, scene]).generate_state(1)[0])
        part = multimodal.columns(task, len(count), seed=scene_seed, image_size=params["image_size"],
                                  distribution=distribution, **options)
        part["scene"] = np.full(len(count), scene, dtype=np.int64)
        parts.append(part)
    return {key: np.concatenate([np.asarray(part[key]) for part in parts]) for key in parts[0] if key != "choices"}


def _require_vqa(task: str, option: str) -> None:
    if task != "vqa":
        raise DataError(f"data.options.{option} applies to multimodal:vqa only, not multimodal:{task}.")


def _subsets(task: str, subsets: Any, params: dict[str, Any], classes: tuple[str, ...], styles: tuple[str, ...],
             seed: int, options: dict[str, Any]) -> dict[str, Any]:
    """One VQA dataset per entry of ``subsets`` (each its own ``num_samples``, styles, classes, question types and
    wording over the source-wide ones), from a seed of its own, concatenated; column ``subset`` = its index."""
    from rayfed.data import multimodal

    _require_vqa(task, "subsets")
    if not isinstance(subsets, (list, tuple)) or not subsets or not all(isinstance(e, Mapping) for e in subsets):
        raise DataError(f"data.options.subsets = {subsets!r} is invalid: it must be a non-empty list of mappings "
                        f"with any of {', '.join(_SUBSET_OPTIONS)}.")
    parts = []
    for index, entry in enumerate(subsets):
        unknown = [key for key in entry if key not in _SUBSET_OPTIONS]
        if unknown:
            raise DataError(f"data.options.subsets[{index}] has no option {unknown[0]!r}"
                            f"{suggest(unknown[0], _SUBSET_OPTIONS)}; allowed: {', '.join(_SUBSET_OPTIONS)}.")
        count = entry.get("num_samples", params["num_samples"])
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise DataError(f"data.options.subsets[{index}].num_samples = {count!r} is invalid: it must be an "
                            "integer >= 1.")
        part_options = dict(options)
        for key in ("question_types", "wording"):
            if key in entry:
                part_options[key] = tuple(entry[key]) if key == "question_types" else entry[key]
        distribution = multimodal.Distribution(tuple(entry.get("classes", classes)), tuple(entry.get("styles", styles)),
                                               (task,))
        part_seed = int(np.random.SeedSequence([seed, _PURPOSE_SUBSETS, index]).generate_state(1)[0])
        try:
            part = multimodal.columns(task, count, seed=part_seed, image_size=params["image_size"],
                                      distribution=distribution, **part_options)
        except ConfigError as err:
            raise DataError(f"data.options.subsets[{index}].{str(err)}") from None
        part["subset"] = np.full(count, index, dtype=np.int64)
        parts.append(part)
    return {key: np.concatenate([np.asarray(part[key]) for part in parts]) for key in parts[0] if key != "choices"}


def _multimodal_dataset(task: str, columns: dict[str, Any], group_column: str | None) -> ArrayDataset:
    from rayfed.data import multimodal

    images = None
    if task in ("shapes", "vqa"):
        images = np.asarray(columns["image"]).astype(np.float32) / 255.0
    labels, class_names, choices, text = None, (), None, _strings(columns["text"])
    if task == "shapes":
        labels = np.asarray(columns["label"], np.int64)
        class_names, text = multimodal.CLASSES, None  # the caption names the class: it is a target, not an input
    elif task == "vqa":
        labels, class_names = np.asarray(columns["label"], np.int64), multimodal.VQA_ANSWERS
    elif task == "topics":
        labels, class_names = np.asarray(columns["label"], np.int64), tuple(multimodal.TOPICS)
    elif task == "multiple-choice":
        labels, class_names = np.asarray(columns["label"], np.int64), ("A", "B", "C", "D")
        choices = np.asarray(columns["choices"], dtype=object)
    target = _strings(columns["text"] if task == "shapes" else columns["target"])
    if task == "statements":
        text, target = _strings([""] * len(columns["text"])), _strings(columns["text"])
    groups, domains = None, ()
    if group_column is not None:
        values = np.asarray(columns[group_column])
        domains_found, groups = np.unique(values, return_inverse=True)
        domains, groups = tuple(str(v) for v in domains_found), groups.astype(np.int64).reshape(-1)
    return ArrayDataset(images, labels, class_names, groups, text=text, target=target, choices=choices, domains=domains)
