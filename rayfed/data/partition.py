"""Split a labelled dataset into federated clients, and each client into train and test.

:func:`partition` resolves the partitioner plug-in and checks what it returns. What a partitioner is asked for and
may return is :mod:`rayfed.data.partition_request`'s, the built-in partitioners are
:mod:`rayfed.data.partitioners`', the train / test cuts :mod:`rayfed.data.train_test`'s; every name is importable
from here. All functions are pure: the same inputs and seed give the same index arrays. Every random draw
uses its own stream ``np.random.SeedSequence([seed, purpose, ...])``, never the global RNG.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfed.data import partitioners  # noqa: F401 (registers the built-in partitioners)
from rayfed.data.partition_request import LabelSpace, Partition, PartitionRequest, SharedTest  # noqa: F401
from rayfed.data.sources import DataError
from rayfed.data.train_test import exact_test_split, global_test_indices, split_train_test  # noqa: F401
from rayfed.registry import resolve


def partition(
    labels: np.ndarray,
    num_clients: int,
    method: Any,
    *,
    seed: int,
    groups: np.ndarray | None = None,
    test_fraction: float = 0.25,
    class_names: tuple[str, ...] = (),
    options: dict[str, Any] | None = None,
    **fields: Any,
) -> list[np.ndarray] | Partition:
    """Index arrays (sorted, int64, disjoint) one per client, client i = list index i; or, from a partitioner that
    cuts train and test itself, its checked :class:`Partition`.

    ``method`` is a partitioner plug-in (a registered name such as ``dirichlet``, an import path or a
    function of a :class:`PartitionRequest`); ``fields`` are the partition config's (alpha, ...).
    Every client must end with at least ``min_samples`` samples, else :class:`DataError`.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"data.label_column: labels must be one value per sample, got shape {labels.shape}.")
    if num_clients <= 0:
        raise DataError(f"data.num_clients = {num_clients} is invalid: it must be >= 1.")
    request = PartitionRequest(labels, num_clients, seed, groups, test_fraction=test_fraction,
                               class_names=tuple(class_names), options=dict(options or {}), **fields)
    if request.min_samples < 1:
        raise DataError(f"data.partition.min_samples = {request.min_samples} is invalid: it must be >= 1.")
    resolved = resolve("partitioner", method)
    clients = resolved.obj(request)
    if isinstance(clients, Partition):
        return _checked_partition(clients, request, resolved.name)
    if request.options:
        raise DataError(f"data.partition.options is set but data.partition.name = {resolved.name!r} takes no options "
                        "(it returns index arrays only); remove them.")
    if not isinstance(clients, (list, tuple)) or len(clients) != num_clients:
        got = f"{len(clients)} index arrays" if isinstance(clients, (list, tuple)) else f"a {type(clients).__name__}"
        raise DataError(f"data.partition.name = {resolved.name!r} returned {got}; expected a list of "
                        f"data.num_clients = {num_clients} index arrays, one per client.")
    clients = [np.asarray(indices, dtype=np.int64).reshape(-1) for indices in clients]
    held = np.concatenate(clients) if clients else np.array([], np.int64)
    if len(held) and (held.min() < 0 or held.max() >= len(labels) or len(np.unique(held)) != len(held)):
        raise DataError(f"data.partition.name = {resolved.name!r} returned indices that repeat or fall outside the "
                        f"{len(labels)} samples; clients must hold disjoint samples.")
    settings = "".join(f", {name} = {value}" for name, value in fields.items()
                       if value is not None and name != "min_samples")
    _check_client_sizes(clients, request.min_samples, f"{resolved.name} over {num_clients} clients{settings}")
    return [np.sort(indices) for indices in clients]


def _checked_partition(cut: Partition, request: PartitionRequest, name: str) -> Partition:
    """``cut`` with int64 index arrays, once its clients, label spaces and shared tests are consistent."""
    where = f"data.partition.name = {name!r} returned a Partition"
    if len(cut.splits) != request.num_clients:
        raise DataError(f"{where} of {len(cut.splits)} clients; expected data.num_clients = {request.num_clients}.")
    size = len(request.labels)
    splits = tuple(tuple(np.asarray(part, dtype=np.int64).reshape(-1) for part in split) for split in cut.splits)
    for client, (train, test) in enumerate(splits):
        if not len(train) or not len(test):
            raise DataError(f"{where} in which client {client} has no {'training' if not len(train) else 'test'} "
                            "samples; every client needs both.")
    held = np.concatenate([np.concatenate(split) for split in splits])
    if held.min() < 0 or held.max() >= size or len(np.unique(held)) != len(held):
        raise DataError(f"{where} whose indices repeat or fall outside the {size} samples; clients must hold "
                        "disjoint samples.")
    classes = sorted(label for space in cut.label_spaces for label in space.classes)
    if cut.label_spaces and classes != list(range(len(request.class_names))):
        raise DataError(f"{where} whose label spaces do not hold each of the {len(request.class_names)} classes "
                        "exactly once.")
    shared = tuple(SharedTest(test.name, np.asarray(test.indices, dtype=np.int64), test.space, test.exclude_own_classes)
                   for test in cut.shared_tests)
    for test in shared:
        if not 0 <= test.space < max(len(cut.label_spaces), 1) or (len(test.indices) and not
                                                                  0 <= test.indices.min() <= test.indices.max() < size):
            raise DataError(f"{where} whose shared test {test.name!r} names label space {test.space} or samples "
                            "that do not exist.")
    return Partition(splits, cut.label_spaces, shared)


def _check_client_sizes(clients: list[np.ndarray], min_samples: int, reason: str) -> None:
    sizes = [len(indices) for indices in clients]
    smallest = int(np.argmin(sizes))
    if sizes[smallest] == 0:
        raise DataError(
            f"data.partition: client {smallest} has no samples ({reason}); "
            f"use fewer data.num_clients or more data."
        )
    if sizes[smallest] < min_samples:
        raise DataError(
            f"data.partition: client {smallest} has only {sizes[smallest]} sample(s), fewer than "
            f"data.partition.min_samples = {min_samples} ({reason}); use fewer data.num_clients or more data."
        )
