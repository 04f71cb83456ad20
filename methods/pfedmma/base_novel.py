"""Base-to-novel federated splits of pFedMMA (*pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for
Vision-Language Models*; docs/pfedmma.md#data-and-metrics).

The classes, sorted by label id, are cut in two: the first ceil(C/2) are *base* classes, the rest
*novel*; each half is relabelled 0..k-1 and is one task (label space) of the run. The base classes
are shuffled with a fixed seed and dealt to clients in contiguous chunks of round(B/N) classes, the last
client taking the remainder ("pathological" split, no overlap). A client trains on K shots of each of its
classes and is tested on all test images of its classes, over all B base classes. Every client is also
scored on the whole base test split (B-way) and the whole novel test split (novel-way).
"""

from __future__ import annotations

import math

import numpy as np

from rayfed.config import BaseNovelConfig
from rayfed.data.partition import split_train_test
from rayfed.data.sources import ArrayDataset, DataError
from rayfed.tasks import Task

_PURPOSE_SHOTS = 0xBA5E


def base_novel_split(
    dataset: ArrayDataset, num_clients: int, config: BaseNovelConfig, test_fraction: float, seed: int
) -> tuple[ArrayDataset, list[tuple[np.ndarray, np.ndarray]], tuple[Task, Task], dict[str, tuple[np.ndarray, int, bool]]]:
    """(relabelled dataset, per-client (train, test) indices, the (base, novel) tasks, shared eval sets).

    The pooled dataset is first split into train and test per class (``test_fraction``, stratified).
    Shared eval sets map a name to (indices, task index, whether a client's own classes are left out).
    """
    num_classes = dataset.num_classes
    num_base = math.ceil(num_classes / 2)
    if num_classes < 2:
        raise DataError(f"data.base_novel needs at least 2 classes; data.source has {num_classes}.")
    chunk = round(num_base / num_clients)
    if chunk == 0 or chunk * (num_clients - 1) >= num_base:
        raise DataError(
            f"data.base_novel: {num_base} base classes cannot be dealt in chunks of round({num_base}/{num_clients}) "
            f"to data.num_clients = {num_clients} with the last client keeping at least one; use fewer clients."
        )
    (train, test), = split_train_test([np.arange(len(dataset))], dataset.labels, test_fraction, seed=seed)
    order = np.random.default_rng(config.class_seed).permutation(num_base)
    chunks = [order[i * chunk:(i + 1) * chunk] for i in range(num_clients - 1)] + [order[(num_clients - 1) * chunk:]]
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SHOTS]))
    splits = []
    for client, classes in enumerate(chunks):
        shots = []
        for label in np.sort(classes):
            members = train[dataset.labels[train] == label]
            if len(members) < config.shots:
                raise DataError(
                    f"data.base_novel.shots = {config.shots} but class {dataset.class_names[label]!r} (client {client}) "
                    f"has only {len(members)} training samples; lower data.base_novel.shots."
                )
            shots.append(rng.choice(members, size=config.shots, replace=False))
        own_test = test[np.isin(dataset.labels[test], classes)]
        splits.append((np.sort(np.concatenate(shots)), own_test))
    is_base = dataset.labels < num_base
    relabelled = ArrayDataset(
        dataset.images, np.where(is_base, dataset.labels, dataset.labels - num_base), dataset.class_names, dataset.groups
    )
    tasks = (Task(0, "base", dataset.class_names[:num_base]), Task(1, "novel", dataset.class_names[num_base:]))
    eval_sets = {"base": (test[is_base[test]], 0, config.base_excludes_local), "novel": (test[~is_base[test]], 1, False)}
    return relabelled, splits, tasks, eval_sets
