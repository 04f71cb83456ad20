"""The image column of a ``datasets`` Dataset, kept undecoded until the rows a run uses are known."""

from __future__ import annotations

import dataclasses
import functools
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfed.data.sources.dataset import DataError, PendingImages
from rayfed.data.sources.images import Resize, decode_images
from rayfed.models.image_processing import ImagePreprocessing

_CHUNK = 256  # rows read from the table at a time
_SWAPPED_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that datasets' decoding turns by 90 degrees


@dataclass(frozen=True, eq=False)
class HFImages(PendingImages):
    """The rows ``rows`` of ``table`` (the image column alone, images read as stored); ``counts``: each row's number
    of images, where a row holds a list of them; ``resize``: ``data.resize`` (a size or the backbone's processing)."""

    table: Any  # a datasets.Dataset of the one column, in arrow format where it holds image files
    column: str
    decode_one: Any  # a stored value -> a PIL image (None: the value is the array itself)
    rows: np.ndarray
    resize: Resize = None
    counts: np.ndarray | None = None
    files: int | None = None  # the bytes of the dataset's files on disk
    mode: str | None = None  # the PIL mode the column's feature converts its images to

    @classmethod
    def of(cls, loaded: Any, column: str, resize: Resize) -> HFImages:
        import datasets
        import pyarrow.compute

        feature = loaded.features[column]
        several = isinstance(feature, (datasets.List, datasets.LargeList, datasets.Sequence)) and isinstance(
            feature.feature, datasets.Image)
        image = feature.feature if several else feature
        table, decode_one, counts, mode = loaded.select_columns([column]), None, None, None
        if isinstance(image, datasets.Image):  # read as stored ({bytes, path}), each decoded by the feature
            table, decode_one, mode = table.with_format("arrow"), image.decode_example, image.mode
        if several:  # the lists' lengths, read without turning the images into Python objects
            counts = np.concatenate([np.empty(0, np.int64), *(
                pyarrow.compute.list_value_length(table[start:start + 16 * _CHUNK][column]).fill_null(0).to_numpy(
                    zero_copy_only=False) for start in range(0, len(table), 16 * _CHUNK))]).astype(np.int64)
        files = {entry["filename"] for entry in loaded.cache_files}
        size = sum(os.path.getsize(name) for name in files if os.path.isfile(name)) if files else None
        return cls(table, column, decode_one, np.arange(len(table)), resize, counts, size, mode)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, indices: np.ndarray) -> HFImages:
        return dataclasses.replace(self, rows=self.rows[indices],
                                   counts=None if self.counts is None else self.counts[indices])

    @property
    def shape(self) -> tuple[int, ...]:
        several = () if self.counts is None else (int(self.counts.max(initial=0)),)
        return (len(self.rows), *several, *self._image_shape)

    @property
    def dtype(self) -> np.dtype:
        if self.decode_one is not None or self.resize is not None:
            return np.dtype(np.uint8)
        first = self._first
        return np.dtype(np.uint8 if first is None or np.issubdtype(np.asarray(first).dtype, np.integer) else np.float32)

    @property
    def files_bytes(self) -> int | None:
        return self.files

    def decode(self) -> np.ndarray:
        """The rows' images, decoded one by one (:func:`~rayfed.data.sources.images.decode_images`)."""
        return decode_images(self._values, len(self.rows), self.column, self.resize, self.counts)

    @functools.cached_property
    def _image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of every image after ``resize``; without it, the first image's, from its file's header."""
        if isinstance(self.resize, int):
            return self.resize, self.resize, 3
        if isinstance(self.resize, ImagePreprocessing):
            return (*self.resize.output_size, 3)
        first = self._first
        if first is None:
            return 0, 0, 0
        if self.decode_one is None:
            shape = np.asarray(first).shape
            return (*shape, 1) if len(shape) == 2 else shape
        from PIL import Image

        with Image.open(first["path"] if first["bytes"] is None else io.BytesIO(first["bytes"])) as image:
            width, height = image.size
            # (EXIF read at opening; a PNG's getexif would decode the image to look for it after the pixels)
            if "exif" in image.info and image.getexif().get(Image.ExifTags.Base.Orientation) in _SWAPPED_ORIENTATIONS:
                width, height = height, width
            return height, width, 1 if (self.mode or image.mode) in ("1", "L", "LA") else 3

    @functools.cached_property
    def _first(self) -> Any:
        """The first stored image of the rows (None: there is none)."""
        for value in self._stored():
            if self.counts is None:
                return value
            if value:
                return value[0]
        return None

    def _stored(self) -> Iterator[Any]:
        for start in range(0, len(self.rows), _CHUNK):
            values = self.table[self.rows[start:start + _CHUNK].tolist()][self.column]
            for value in values.to_pylist() if self.decode_one is not None else values:
                if value is None and self.counts is None:
                    raise DataError(f"data.image_column = {self.column!r} has a sample without an image; drop such "
                                    "samples first (datasets' Dataset.filter).")
                yield value

    def _values(self) -> Iterator[Any]:
        for value in self._stored():
            if self.decode_one is None:
                yield value
            elif self.counts is None:
                yield self.decode_one(value)
            else:
                yield [self.decode_one(image) for image in value or ()]
