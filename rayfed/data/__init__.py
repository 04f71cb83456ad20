"""Federated data: in-memory sources, client partitioners, and per-client named tensors."""

from rayfed.data.partition import PartitionRequest, partition, split_train_test
from rayfed.data.sources import ArrayDataset, DataError, SourceRequest, load_source

__all__ = [
    "ArrayDataset",
    "DataError",
    "PartitionRequest",
    "SourceRequest",
    "load_source",
    "partition",
    "split_train_test",
]
