"""Each client's samples cut into train and test (stratified, or an exact number of test samples a client), and a
test set of the samples no client holds. Pure functions: the same inputs and seed give the same index arrays."""

from __future__ import annotations

import numpy as np

from rayfed.data.partition_request import PURPOSE_GLOBAL_TEST, PURPOSE_TRAIN_TEST, seeded_rng
from rayfed.data.partitioners import balanced_quotas
from rayfed.data.sources import DataError


def split_train_test(
    client_indices: list[np.ndarray], labels: np.ndarray, test_fraction: float, *, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split each client's own indices into (train, test), per class (stratified) so each client's
    test set follows its own label distribution; each client must end with >= 1 train and >= 1 test
    sample, else DataError naming the client.

    A class keeps at least one training sample whenever the client's test size allows it.
    """
    if not 0 < test_fraction < 1:
        raise DataError(f"data.test_fraction = {test_fraction} is invalid: it must be between 0 and 1 (exclusive).")
    labels = np.asarray(labels)
    splits = []
    for client, indices in enumerate(client_indices):
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) < 2:
            raise DataError(
                f"data.partition: client {client} has {len(indices)} sample(s), too few to split into train and "
                f"test (data.test_fraction = {test_fraction}); it needs at least 2."
            )
        rng = seeded_rng(seed, PURPOSE_TRAIN_TEST, client)
        client_labels = labels[indices]
        classes, class_sizes = np.unique(client_labels, return_counts=True)
        test_counts = _stratified_test_counts(class_sizes, test_fraction)
        train_parts, test_parts = [], []
        for label, test_count in zip(classes, test_counts):
            members = rng.permutation(indices[client_labels == label])
            test_parts.append(members[:test_count])
            train_parts.append(members[test_count:])
        splits.append((np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(test_parts))))
    return splits


def _stratified_test_counts(class_sizes: np.ndarray, test_fraction: float) -> np.ndarray:
    """Per-class test counts summing to round(test_fraction * n), clamped to 1..n-1 (largest remainder).

    Classes first keep one training sample each; only if that cannot reach the total is it relaxed.
    """
    total = int(class_sizes.sum())
    target = min(max(round(test_fraction * total), 1), total - 1)
    ideal = test_fraction * class_sizes
    counts = np.floor(ideal).astype(np.int64)
    for caps in (class_sizes - 1, class_sizes):
        while counts.sum() < target:
            room = counts < caps
            if not room.any():
                break
            counts[np.argmax(np.where(room, ideal - counts, -np.inf))] += 1
    return counts


def exact_test_split(
    client_indices: list[np.ndarray], labels: np.ndarray, test_samples: int, *, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split each client into exactly ``test_samples`` test samples, spread evenly over the client's
    classes (sorted, larger quotas first), and the rest for training; every class keeps >= 1 of each."""
    labels = np.asarray(labels)
    splits = []
    for client, indices in enumerate(client_indices):
        rng = seeded_rng(seed, PURPOSE_TRAIN_TEST, client)
        client_labels = labels[indices]
        classes = np.unique(client_labels)
        train_parts, test_parts = [], []
        for label, quota in zip(classes, balanced_quotas(test_samples, len(classes))):
            members = rng.permutation(indices[client_labels == label])
            if not 1 <= quota < len(members):
                raise DataError(
                    f"data.partition.test_samples_per_client = {test_samples}: client {client} has {len(members)} "
                    f"samples of class {label} and cannot keep both train and test samples of it; "
                    f"use a value between {len(classes)} and data.partition.samples_per_client."
                )
            test_parts.append(members[:quota])
            train_parts.append(members[quota:])
        splits.append((np.sort(np.concatenate(train_parts)), np.sort(np.concatenate(test_parts))))
    return splits


def global_test_indices(
    splits: list[tuple[np.ndarray, np.ndarray]], num_samples: int, size: int, *, seed: int
) -> np.ndarray:
    """``size`` sample indices (sorted) drawn uniformly from the samples no client holds: a test set of the
    whole label distribution (a global accuracy)."""
    held = np.concatenate([np.concatenate(split) for split in splits]) if splits else np.array([], dtype=np.int64)
    free = np.setdiff1d(np.arange(num_samples), held)
    if size > len(free):
        raise DataError(
            f"data.partition.global_test_samples = {size} is more than the {len(free)} samples no client holds; "
            f"use at most {len(free)}, or load more samples."
        )
    return np.sort(seeded_rng(seed, PURPOSE_GLOBAL_TEST).choice(free, size=size, replace=False))
