"""Federated classification data: in-memory sources and client partitioners."""

from rayfed.data.partition import PARTITIONERS, partition, split_train_test
from rayfed.data.sources import SOURCES, ArrayDataset, DataError, load_source

__all__ = [
    "PARTITIONERS",
    "SOURCES",
    "ArrayDataset",
    "DataError",
    "load_source",
    "partition",
    "split_train_test",
]
