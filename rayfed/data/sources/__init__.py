"""Datasets loaded into memory, from the built-in sources or a user's own (``data.source``).

Every source yields an :class:`ArrayDataset` of named columns, each one value per sample: images
(N, H, W, C), uint8 pixels 0..255 or float32 in [0, 1] (turned into float32 batch by batch; (N, K, H, W, C) with
``image_counts`` where a sample has several), int64 labels 0..K-1 with their class names, input ``text``, output
``target`` text, the ``choices`` of a multiple-choice question, and, where the data has them, natural
per-sample ``groups`` (writers, render styles, question types) for the partitioners.

A source is a plug-in (:mod:`rayfed.registry`): a function ``source(request: SourceRequest)`` returning
an :class:`ArrayDataset`, a dict of columns (``image``, ``label``, ``text``, ``target``, ``choices``,
``class_names``, and the ``data.partition.column`` if any), an ``(images, labels)`` pair, or a
``datasets.Dataset`` (read with ``data.*_column``).

Each module holds one job: :mod:`~rayfed.data.sources.dataset` (the dataset and request types),
:mod:`~rayfed.data.sources.loading` (:func:`load_source`, what a source may return), ``common`` (checks and
helpers the sources share) and one module per family of built-in sources: ``digits``, ``fashion_mnist``,
``hf``, ``generators`` (synthetic, synthetic-text, shapes) and ``multimodal_tasks`` (multimodal:<task>).
"""

from __future__ import annotations

# The families first, in this order: the order rayfed.registry lists the built-in sources in.
from rayfed.data.sources import digits, fashion_mnist, hf, generators, multimodal_tasks  # noqa: F401, I001
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.data.sources.fashion_mnist import FASHION_MNIST_CLASSES, FASHION_MNIST_DEFAULT_DIR
from rayfed.data.sources.common import generator_options, non_negative, require_no_group_column, require_no_split
from rayfed.data.sources.generators import SHAPES_GROUP_COLUMN, SYNTHETIC_GROUP_COLUMN
from rayfed.data.sources.loading import as_dataset, load_source
from rayfed.data.sources.multimodal_tasks import MULTIMODAL_GROUP_COLUMNS

__all__ = [
    "FASHION_MNIST_CLASSES", "FASHION_MNIST_DEFAULT_DIR", "MULTIMODAL_GROUP_COLUMNS", "SHAPES_GROUP_COLUMN",
    "SYNTHETIC_GROUP_COLUMN", "ArrayDataset", "DataError", "SourceRequest", "as_dataset", "generator_options",
    "load_source", "non_negative", "require_no_group_column", "require_no_split",
]
