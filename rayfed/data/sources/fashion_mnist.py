"""Fashion-MNIST from its IDX files."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from rayfed.data.sources.common import require_no_group_column, _require_no_options
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.registry import register_source

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


@register_source("fashion_mnist")
def _load_fashion_mnist(request: SourceRequest) -> ArrayDataset:
    """Fashion-MNIST (70,000 28x28 images, 10 classes) from IDX files, Debian's dataset-fashion-mnist by default."""
    _require_no_options(request)
    require_no_group_column(request.name, request.config.partition.column)
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
