"""Classification datasets loaded into memory as numpy arrays.

Every source yields an :class:`ArrayDataset`: float32 images (N, H, W, C) in [0, 1], int64 labels
0..K-1, the class names and, where the data has them, natural per-sample groups (e.g. writers).
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rayfed.errors import ConfigError, suggest

SOURCES: tuple[str, ...] = ("sklearn:digits", "fashion_mnist", "hf:<dataset>", "synthetic", "shapes", "parts")

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
_SHAPES_DEFAULTS: dict[str, Any] = {"num_samples": 4800, "styles": ["noisy"], "image_size": 32}
_PARTS_DEFAULTS: dict[str, Any] = {"num_samples": 6000, "label_space": "fine", "world": 0, "noise": 0.1}
SHAPES_GROUP_COLUMN = "domain"  # the shapes source's natural groups: render styles
_WRITER_STYLE_SCALE = 0.15

# Fixed stream ids: each random draw in this module gets its own SeedSequence([seed, purpose]).
_PURPOSE_SYNTHETIC = 1001
_PURPOSE_SUBSET = 1002


class DataError(ConfigError):
    """Bad data input; the message is one sentence naming the field, the value and what is allowed."""


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """An in-memory classification dataset."""

    images: np.ndarray  # float32, (N, H, W, C), values in [0, 1]
    labels: np.ndarray  # int64, (N,), values in 0..num_classes-1
    class_names: tuple[str, ...]
    groups: np.ndarray | None = None  # (N,) natural group id per sample, for the `natural` partitioner

    def __post_init__(self) -> None:
        if self.images.ndim != 4 or self.images.dtype != np.float32:
            raise ValueError(f"images must be float32 (N, H, W, C), got {self.images.dtype} {self.images.shape}")
        if self.labels.shape != (len(self.images),) or self.labels.dtype != np.int64:
            raise ValueError(f"labels must be int64 ({len(self.images)},), got {self.labels.dtype} {self.labels.shape}")
        if self.groups is not None and self.groups.shape != self.labels.shape:
            raise ValueError(f"groups must have shape {self.labels.shape}, got {self.groups.shape}")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> ArrayDataset:
        """The samples at ``indices``, in that order."""
        groups = None if self.groups is None else self.groups[indices]
        return ArrayDataset(self.images[indices], self.labels[indices], self.class_names, groups)


def load_source(
    source: str,
    *,
    path: str | None = None,
    split: str | None = None,
    image_column: str = "image",
    label_column: str = "label",
    group_column: str | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    synthetic: dict[str, Any] | None = None,
    resize: int | None = None,
    group_size: tuple[int, int | None] = (1, None),
) -> ArrayDataset:
    """Load ``source`` (one of :data:`SOURCES`) into memory, optionally keeping a seeded subset.

    ``resize``: hf: images are converted to RGB and resized to ``resize`` x ``resize`` as they are read
    (real datasets whose images differ in size). With a group column, only samples of groups whose
    size is within ``group_size`` (min, max or None) are kept; for ``hf:`` sources they are selected
    before any image is decoded.
    """
    if max_samples is not None and max_samples <= 0:
        raise DataError(f"data.max_samples = {max_samples} is invalid: it must be > 0 (or unset for all samples).")
    if synthetic is not None and source not in ("synthetic", "shapes", "parts"):
        raise DataError(
            f"data.synthetic is set but data.source = {source!r}; it only applies to 'synthetic', 'shapes' and 'parts'."
        )
    if resize is not None and not source.startswith("hf:"):
        raise DataError(f"data.resize = {resize} is set but data.source = {source!r}; it only applies to hf: sources.")
    if source == "sklearn:digits":
        _require_no_split(source, split)
        _require_no_group_column(source, group_column)
        dataset = _load_digits()
    elif source == "fashion_mnist":
        _require_no_group_column(source, group_column)
        dataset = _load_fashion_mnist(path, split)
    elif source.startswith("hf:"):
        dataset = _load_hf(
            source.removeprefix("hf:"), path, split, image_column, label_column, group_column, resize, group_size
        )
    elif source == "synthetic":
        _require_no_split(source, split)
        _require_group_column(source, group_column, SYNTHETIC_GROUP_COLUMN)
        dataset = _make_synthetic(seed, synthetic or {})
    elif source == "shapes":
        _require_no_split(source, split)
        _require_group_column(source, group_column, SHAPES_GROUP_COLUMN)
        dataset = _make_shapes(seed, synthetic or {})
    elif source == "parts":
        _require_no_split(source, split)
        _require_no_group_column(source, group_column)
        dataset = _make_parts(seed, synthetic or {})
    else:
        raise DataError(
            f"data.source = {source!r} is not known{suggest(source, SOURCES)}; allowed: {', '.join(SOURCES)}."
        )
    if group_column is not None and group_size != (1, None) and not source.startswith("hf:"):  # hf: filtered above
        dataset = dataset.subset(_rows_of_sized_groups(dataset.groups, group_size))
    if max_samples is not None and max_samples < len(dataset):
        rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SUBSET]))
        dataset = dataset.subset(np.sort(rng.choice(len(dataset), size=max_samples, replace=False)))
    return dataset


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


def _load_digits() -> ArrayDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    return ArrayDataset(images, digits.target.astype(np.int64), tuple(str(d) for d in range(10)))


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST from IDX files


def _load_fashion_mnist(path: str | None, split: str | None) -> ArrayDataset:
    if split not in (None, "train", "test"):
        raise DataError(
            f"data.split = {split!r} is not a Fashion-MNIST split; use 'train', 'test' or leave it unset for both."
        )
    folder = Path(path if path is not None else FASHION_MNIST_DEFAULT_DIR)
    splits = [split] if split is not None else ["train", "test"]
    needed = [folder / name for s in splits for name in _FASHION_MNIST_FILES[s]]
    if not all(f.is_file() for f in needed):
        field = "data.path" if path is not None else "data.path (unset, default)"
        raise DataError(
            f"{field}: '{folder}' has no Fashion-MNIST IDX files ({', '.join(f.name for f in needed)}); "
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


def _load_hf(
    name: str,
    path: str | None,
    split: str | None,
    image_column: str,
    label_column: str,
    group_column: str | None,
    resize: int | None = None,
    group_size: tuple[int, int | None] = (1, None),
) -> ArrayDataset:
    import datasets

    location = path if path is not None else name
    if not location:
        raise DataError("data.source = 'hf:' names no dataset; use 'hf:<hub name or save_to_disk folder>'.")
    if path is not None and not os.path.isdir(path):
        raise DataError(f"data.path = {path!r} is not a folder written by save_to_disk.")
    try:
        if os.path.isdir(location):
            loaded = datasets.load_from_disk(location)
        else:
            loaded = datasets.load_dataset(name, split=split or "train")
    except Exception as err:  # offline, unknown name, unreadable folder, ...: all reported the same way
        raise DataError(f"data.source = 'hf:{name}' could not be loaded ({type(err).__name__}: {err}).") from err

    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            loaded = datasets.concatenate_datasets(list(loaded.values()))
        elif split in loaded:
            loaded = loaded[split]
        else:
            raise DataError(
                f"data.split = {split!r} is not a split of 'hf:{name}'{suggest(split, loaded)}; "
                f"available: {', '.join(loaded)}."
            )

    columns = [("data.image_column", image_column), ("data.label_column", label_column)]
    if group_column is not None:
        columns.append(("data.partition.column", group_column))
    for field, column in columns:
        if column not in loaded.column_names:
            raise DataError(
                f"{field} = {column!r} is not a column of 'hf:{name}'{suggest(column, loaded.column_names)}; "
                f"columns: {', '.join(loaded.column_names)}."
            )

    if group_column is not None and group_size != (1, None):
        loaded = loaded.select(_rows_of_sized_groups(np.asarray(loaded[group_column]), group_size))
    images = _stack_images(loaded[image_column], image_column, resize)
    labels, class_names = _encode_labels(loaded[label_column], loaded.features[label_column], label_column)
    groups = np.asarray(loaded[group_column]) if group_column is not None else None
    return ArrayDataset(images, labels, class_names, groups)


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


def _generator_options(
    options: dict[str, Any], defaults: dict[str, Any], source_note: str, positive_ints: tuple[str, ...]
) -> dict[str, Any]:
    """``data.synthetic`` over a generator's defaults; unknown keys and non-positive counts are errors."""
    unknown = [key for key in options if key not in defaults]
    if unknown:
        raise DataError(
            f"data.synthetic has no option {unknown[0]!r}{suggest(unknown[0], defaults)}{source_note}; "
            f"allowed: {', '.join(defaults)}."
        )
    params = {**defaults, **options}
    for key in positive_ints:
        if not isinstance(params[key], int) or isinstance(params[key], bool) or params[key] < 1:
            raise DataError(f"data.synthetic.{key} = {params[key]!r} is invalid: it must be an integer >= 1.")
    return params


def _non_negative(params: dict[str, Any], key: str) -> float:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise DataError(f"data.synthetic.{key} = {value!r} is invalid: it must be a number >= 0.")
    return value


def _make_synthetic(seed: int, options: dict[str, Any]) -> ArrayDataset:
    """Class prototypes + per-writer style offset + Gaussian noise, clipped to [0, 1]."""
    params = _generator_options(
        options, _SYNTHETIC_DEFAULTS, "", ("num_samples", "num_classes", "image_size", "channels", "num_writers")
    )
    noise = _non_negative(params, "noise")

    num_samples, num_classes, num_writers = params["num_samples"], params["num_classes"], params["num_writers"]
    image_shape = (params["image_size"], params["image_size"], params["channels"])
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SYNTHETIC]))
    prototypes = rng.uniform(0.0, 1.0, size=(num_classes, *image_shape))
    writer_styles = rng.normal(0.0, _WRITER_STYLE_SCALE, size=(num_writers, *image_shape))
    labels = rng.permutation(np.arange(num_samples) % num_classes)
    writers = rng.permutation(np.arange(num_samples) % num_writers)
    pixels = prototypes[labels] + writer_styles[writers] + rng.normal(0.0, noise, size=(num_samples, *image_shape))
    images = np.clip(pixels, 0.0, 1.0).astype(np.float32)
    class_names = tuple(f"class_{k}" for k in range(num_classes))
    return ArrayDataset(images, labels.astype(np.int64), class_names, writers.astype(np.int64))


def _make_shapes(seed: int, options: dict[str, Any]) -> ArrayDataset:
    """The 64 "{colour} {shape}" classes rendered in ``styles`` (:mod:`rayfed.data.multimodal`); groups = style.

    Class ids put the 32 classes with an even (shape + colour) index first, so that the first half (the
    base classes of a base-to-novel split) and the second half each hold every colour and every shape.
    """
    from rayfed.data import multimodal

    params = _generator_options(options, _SHAPES_DEFAULTS, " for 'shapes'", ("num_samples", "image_size"))
    distribution = multimodal.Distribution(multimodal.CLASSES, tuple(params["styles"]), ("shapes",))
    columns = multimodal.shape_columns(params["num_samples"], seed=seed, distribution=distribution,
                                       image_size=params["image_size"])  # fmt: skip
    order = sorted(range(len(multimodal.CLASSES)), key=lambda k: ((k // 8 + k % 8) % 2, k))
    class_names = tuple(multimodal.CLASSES[k] for k in order)
    labels = np.asarray([class_names.index(name) for name in columns["class_name"]], dtype=np.int64)
    styles = np.asarray([multimodal.STYLES.index(name) for name in columns["domain"]], dtype=np.int64)
    return ArrayDataset(columns["image"].astype(np.float32) / 255.0, labels, class_names, styles)


def _make_parts(seed: int, options: dict[str, Any]) -> ArrayDataset:
    """Part-texture layouts (:mod:`rayfed.data.parts`) in one of its label spaces; the world is fixed by
    ``world``, the samples by the run's seed."""
    from rayfed.data import parts

    params = _generator_options(options, _PARTS_DEFAULTS, " for 'parts'", ("num_samples",))
    if params["label_space"] not in parts.LABEL_SPACES:
        raise DataError(
            f"data.synthetic.label_space = {params['label_space']!r} is not known; allowed: {', '.join(parts.LABEL_SPACES)}."
        )
    if isinstance(params["world"], bool) or not isinstance(params["world"], int) or params["world"] < 0:
        raise DataError(f"data.synthetic.world = {params['world']!r} is invalid: it must be an integer >= 0.")
    noise = _non_negative(params, "noise")
    images, labels = parts.render(
        params["num_samples"], label_space=params["label_space"], seed=seed, world_seed=params["world"], noise=noise
    )
    return ArrayDataset(images, labels, parts.class_names(params["label_space"]))
