"""Before images are decoded: the host memory the decoded data will take and its files on disk, one line per source,
and a refusal, naming the settings that shrink it, when it cannot fit the machine's available memory."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import numpy as np

from rayfed.data.sources.dataset import ArrayDataset, DataError

log = logging.getLogger("rayfed.data")


def available_memory() -> int:
    """The bytes of host memory this machine has available now."""
    import psutil

    return int(psutil.virtual_memory().available)


def decode_within_memory(parts: Sequence[tuple[str, str, ArrayDataset]]) -> list[ArrayDataset]:
    """Each ``(where, source, dataset)`` with its images decoded; for those still to decode, first one line each
    (``where``: the config section, ``data`` or ``data.tasks['vqa']``) stating their host memory and files, and one
    sentence refusing them all when together they need more memory than the machine has available."""
    needs = {index: _host_bytes(dataset) for index, (_, _, dataset) in enumerate(parts) if dataset.pending}
    if not needs:
        return [dataset for _, _, dataset in parts]
    for index, need in needs.items():
        where, source, dataset = parts[index]
        log.info("%s.source = %r: %s ≈ %s host memory; files %s", where, source, _described(dataset), _size(need),
                 "unknown" if dataset.images.files_bytes is None else f"≈ {_size(dataset.images.files_bytes)} on disk")
    total, available = sum(needs.values()), available_memory()
    if total > available:
        where = parts[max(needs, key=needs.get)][0]
        raise DataError(
            f"The data needs ≈ {_size(total)} of host memory once its images are decoded, but this machine has "
            f"{_size(available)} available; lower {where}.max_samples, take a slice of {where}.split (e.g. "
            f"'train[:10%]') or set a smaller {where}.resize."
        )
    return [dataset.decoded() for _, _, dataset in parts]


def _host_bytes(dataset: ArrayDataset) -> int:
    """The decoded images' bytes and, roughly, the other columns'."""
    total = dataset.images.nbytes
    for name in ("image_counts", "labels", "groups", "text", "target", "choices"):
        column = getattr(dataset, name)
        if isinstance(column, np.ndarray):
            total += column.nbytes
            if column.dtype == object:  # the Python strings the array points to
                total += sum(sys.getsizeof(value) for value in column.flat)
    return total


def _described(dataset: ArrayDataset) -> str:
    images = dataset.images
    shape = "x".join(str(side) for side in images.shape[-3:])
    if dataset.image_counts is None:
        return f"{len(images):,} images at {shape} {images.dtype}"
    return f"{len(images):,} samples of up to {images.shape[1]} images at {shape} {images.dtype}"


def _size(count: int) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"
