"""Federated data: in-memory sources, client partitioners, and per-client named tensors."""

from rayfed.data.partition import LabelSpace, Partition, PartitionRequest, SharedTest, partition, split_train_test
from rayfed.data.sources import ArrayDataset, DataError, SourceRequest, load_source

__all__ = [
    "ArrayDataset",
    "DataError",
    "LabelSpace",
    "Partition",
    "PartitionRequest",
    "SharedTest",
    "SourceRequest",
    "load_source",
    "partition",
    "split_train_test",
]
