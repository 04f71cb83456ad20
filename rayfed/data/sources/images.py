"""Image columns decoded one image at a time into one preallocated array: uint8 pixels where the images are pixels
(files, integer arrays), float32 in [0, 1] where a source gives floats; one image a sample, or several."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from rayfed.data.sources.dataset import DataError

Resize = int | None  # data.resize: a square size


def decode_images(read: Callable[[], Iterable[Any]], count: int, column: str, resize: Resize = None,
                  counts: np.ndarray | None = None) -> np.ndarray:
    """The ``count`` images ``read()`` yields, one by one, as (N, H, W, C); with ``counts`` (several images a sample)
    ``read()`` yields each sample's list of images and the result is (N, K, H, W, C), K = the most in a sample, the
    rest zero. uint8 where the images are integer pixels 0..255; float images as float32 in [0, 1], read as 0..255
    when any exceeds 1: then ``read`` is called again and each image divided by 255 in float64, as one array of
    them was."""
    pixels, (low, high) = _fill(read(), count, column, resize, counts, scale=False)
    if pixels is None:
        raise DataError(f"data.image_column = {column!r} is empty; the dataset has no samples.")
    if pixels.dtype == np.float32 and high > 1:
        pixels, _ = _fill(read(), count, column, resize, counts, scale=True)
        low, high = low / 255.0, high / 255.0
    if pixels.dtype == np.float32 and (low < 0 or high > 1):  # (integer pixels are checked as they are read)
        raise _outside(column)
    return pixels


def _fill(rows: Iterable[Any], count: int, column: str, resize: Resize, counts: np.ndarray | None,
          scale: bool) -> tuple[np.ndarray | None, tuple[float, float]]:
    """The images preallocated at the first one's shape and type, and the least and largest value read."""
    pixels, low, high = None, np.inf, -np.inf
    for row, value in enumerate(rows):
        for position, image in enumerate(value if counts is not None else [value]):
            array = image_to_hwc(image, column, resize)
            integers = np.issubdtype(array.dtype, np.integer)
            if pixels is None:
                shape = (count, *(() if counts is None else (int(counts.max()),)), *array.shape)
                pixels = np.zeros(shape, np.uint8 if integers else np.float32)
            if array.shape != pixels.shape[-3:]:
                raise DataError(
                    f"data.image_column = {column!r} holds images of different sizes (e.g. {pixels.shape[-3:]} and "
                    f"{array.shape}); set data.resize to a size (e.g. 224) so that all images have the same size."
                )
            if integers != (pixels.dtype == np.uint8):
                raise DataError(f"data.image_column = {column!r} holds both integer and float images; give one kind.")
            if array.size and array.dtype != np.uint8:
                low, high = min(low, float(array.min())), max(high, float(array.max()))
                if integers and (low < 0 or high > 255):
                    raise _outside(column)
            where = (row,) if counts is None else (row, position)
            pixels[where] = np.asarray(array, np.float64) / 255.0 if scale else array
    return pixels, (low, high)


def _outside(column: str) -> DataError:
    return DataError(f"data.image_column = {column!r} has pixel values outside 0..255 (or 0..1 for floats).")


def image_to_hwc(image: Any, image_column: str, resize: Resize = None) -> np.ndarray:
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
