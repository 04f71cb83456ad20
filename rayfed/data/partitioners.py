"""The built-in partitioners (``data.partition.name``): ``iid``, ``dirichlet``, ``shards``, ``natural``,
``presplit``, ``labeldir`` and ``domain_dirichlet``, each a function of a :class:`PartitionRequest` registered on
import (:mod:`rayfed.data.partition` imports this module)."""

from __future__ import annotations

import numpy as np

from rayfed.data.partition_request import (
    PURPOSE_DIRICHLET, PURPOSE_IID, PURPOSE_LABELDIR, PURPOSE_PRESPLIT, PURPOSE_SHARD_CLASSES, PURPOSE_SHARD_SPLIT,
    PURPOSE_SHARD_SUBSET, Partition, PartitionRequest, seeded_rng,
)
from rayfed.data.sources import DataError
from rayfed.registry import register_partitioner

_DIRICHLET_ATTEMPTS = 100


@register_partitioner("iid")
def _iid(request: PartitionRequest) -> list[np.ndarray]:
    """A seeded shuffle cut into equal parts."""
    order = request.rng(PURPOSE_IID).permutation(len(request.labels))
    return np.array_split(order, request.num_clients)


@register_partitioner("dirichlet")
def _dirichlet_request(request: PartitionRequest) -> list[np.ndarray]:
    """Each class split over the clients with proportions ~ Dir(alpha) (label skew)."""
    return _dirichlet(request.labels, request.num_clients, request.alpha, request.min_samples, request.seed)


def _dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float | None, min_samples: int, seed: int
) -> list[np.ndarray]:
    """Each class split over the clients with proportions ~ Dir(alpha); redrawn until all are large enough."""
    if alpha is None:
        raise DataError("data.partition.alpha is required for data.partition.name = 'dirichlet'; set it > 0.")
    if not alpha > 0:
        raise DataError(f"data.partition.alpha = {alpha} is invalid: it must be > 0.")
    rng = seeded_rng(seed, PURPOSE_DIRICHLET)
    class_members = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(_DIRICHLET_ATTEMPTS):
        shares: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in class_members:
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
            for client, part in enumerate(np.split(rng.permutation(members), cuts)):
                shares[client].append(part)
        clients = [np.concatenate(parts) for parts in shares]
        sizes = [len(indices) for indices in clients]
        if min(sizes) >= min_samples:
            return clients
    smallest = int(np.argmin(sizes))
    held = f"only {sizes[smallest]} sample(s)" if sizes[smallest] else "no samples"
    raise DataError(
        f"data.partition: client {smallest} has {held} (data.partition.min_samples = {min_samples}) after "
        f"{_DIRICHLET_ATTEMPTS} Dirichlet draws with data.partition.alpha = {alpha}; "
        f"use a larger data.partition.alpha or fewer data.num_clients."
    )


@register_partitioner("shards")
def _shards(request: PartitionRequest) -> list[np.ndarray]:
    """Every client holds exactly ``classes_per_client`` classes; a class is split evenly among its holders."""
    labels, num_clients, seed = request.labels, request.num_clients, request.seed
    classes_per_client, samples_per_client = request.classes_per_client, request.samples_per_client
    classes = np.unique(labels)
    if classes_per_client is None:
        raise DataError("data.partition.classes_per_client is required for data.partition.name = 'shards'.")
    if not 1 <= classes_per_client <= len(classes):
        raise DataError(
            f"data.partition.classes_per_client = {classes_per_client} is invalid: "
            f"it must be between 1 and the {len(classes)} classes present."
        )
    if samples_per_client is not None and samples_per_client < classes_per_client:
        raise DataError(
            f"data.partition.samples_per_client = {samples_per_client} is invalid: it must be at least "
            f"data.partition.classes_per_client = {classes_per_client} so every class is kept."
        )

    # Round-robin over a shuffled class order: C consecutive slots are distinct classes, and each
    # class is held by floor or ceil of num_clients * C / num_classes clients.
    class_order = seeded_rng(seed, PURPOSE_SHARD_CLASSES).permutation(classes)
    client_classes = [
        [class_order[(client * classes_per_client + slot) % len(classes)] for slot in range(classes_per_client)]
        for client in range(num_clients)
    ]
    split_rng = seeded_rng(seed, PURPOSE_SHARD_SPLIT)
    shard_of: dict[tuple[int, int], np.ndarray] = {}
    for label in classes:
        holders = [client for client, held in enumerate(client_classes) if label in held]
        members = split_rng.permutation(np.flatnonzero(labels == label))
        if not holders:  # fewer client slots than classes: this class is no client's
            continue
        for client, part in zip(holders, np.array_split(members, len(holders))):
            if len(part) == 0:
                raise DataError(
                    f"data.partition: client {client} has no samples of class {label} (it has {len(members)} "
                    f"samples shared by {len(holders)} clients); use fewer data.num_clients or a smaller "
                    f"data.partition.classes_per_client."
                )
            shard_of[client, int(label)] = part

    subset_rng = seeded_rng(seed, PURPOSE_SHARD_SUBSET)
    clients = []
    for client, held in enumerate(client_classes):
        shards = [shard_of[client, int(label)] for label in held]
        if samples_per_client is not None:
            quotas = balanced_quotas(samples_per_client, len(held))
            for label, shard, quota in zip(held, shards, quotas):
                if len(shard) < quota:
                    raise DataError(
                        f"data.partition.samples_per_client = {samples_per_client} is too large: client {client} "
                        f"has only {len(shard)} samples of class {label} and needs {quota}; use a smaller value "
                        f"or fewer data.num_clients."
                    )
            shards = [subset_rng.choice(shard, size=quota, replace=False) for shard, quota in zip(shards, quotas)]
        clients.append(np.concatenate(shards))
    return clients


def balanced_quotas(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` counts that differ by at most one, larger first."""
    base, extra = divmod(total, parts)
    return [base + (1 if part < extra else 0) for part in range(parts)]


@register_partitioner("natural")
def _natural(request: PartitionRequest) -> list[np.ndarray]:
    """One client per distinct group value, in sorted order; the first ``num_clients`` groups are used."""
    labels, num_clients, groups = request.labels, request.num_clients, request.groups
    if groups is None:
        raise DataError(
            "data.partition.column must name a column whose values are the clients for "
            "data.partition.name = 'natural'; this dataset has no groups."
        )
    groups = np.asarray(groups)
    if groups.shape != labels.shape:
        raise DataError(
            f"data.partition.column: the dataset has {groups.size} group values for {labels.size} samples; "
            f"there must be one per sample."
        )
    group_values = np.unique(groups)
    if num_clients > len(group_values):
        raise DataError(
            f"data.num_clients = {num_clients} is more than the {len(group_values)} groups in "
            f"data.partition.column; use at most {len(group_values)} clients with 'natural'."
        )
    return [np.flatnonzero(groups == value) for value in group_values[:num_clients]]


@register_partitioner("presplit")
def _presplit(request: PartitionRequest) -> Partition:
    """The dataset's own train and test samples, each sample's split ('train' or 'test') read from
    data.partition.column; each split is dealt to the clients by a seeded shuffle cut into equal parts."""
    if request.groups is None:
        raise DataError("data.partition.column must name the column holding each sample's split ('train' or 'test') "
                        "for data.partition.name = 'presplit'.")
    splits = np.asarray(request.groups).astype(str)
    unknown = sorted({str(split) for split in np.unique(splits)} - {"train", "test"})
    if unknown:
        raise DataError(f"data.partition.column holds the split {unknown[0]!r}; data.partition.name = 'presplit' "
                        "takes 'train' and 'test' only.")
    parts = [np.array_split(request.rng(PURPOSE_PRESPLIT, index).permutation(np.flatnonzero(splits == split)),
                            request.num_clients) for index, split in enumerate(("train", "test"))]
    return Partition(tuple((np.sort(train), np.sort(test)) for train, test in zip(*parts)))


@register_partitioner("labeldir")
def _labeldir_request(request: PartitionRequest) -> list[np.ndarray]:
    """Per class, Dir(alpha) proportions capped at an equal share per client (NIID-Bench's "noniid-labeldir")."""
    _require_alpha(request.alpha, "labeldir")
    return _labeldir(np.arange(len(request.labels)), request.labels, request.num_clients, request.alpha,
                     request.min_samples, request.rng(PURPOSE_LABELDIR))


def _require_alpha(alpha: float | None, method: str) -> None:
    if alpha is None or not alpha > 0:
        raise DataError(f"data.partition.alpha = {alpha} is invalid for data.partition.name = {method!r}: set it > 0.")


def _labeldir(
    indices: np.ndarray, labels: np.ndarray, num_clients: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """The "noniid-labeldir" split of ``indices`` (NIID-Bench's, arXiv 2102.02079): per class, proportions
    ~ Dir(alpha), zeroed for clients already holding >= len(indices) / num_clients samples and renormalized; the whole
    draw is repeated until every client has ``min_samples``. Train and test are cut afterwards per client and per class,
    so a client's test set has its train set's label proportions."""
    cap = len(indices) / num_clients
    classes = np.unique(labels[indices])
    for _ in range(_DIRICHLET_ATTEMPTS):
        shares: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients)
        for label in classes:
            members = rng.permutation(indices[labels[indices] == label])
            proportions = rng.dirichlet(np.full(num_clients, alpha)) * (sizes < cap)
            total = proportions.sum()
            proportions = proportions / total if total > 0 else np.full(num_clients, 1 / num_clients)
            cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
            for client, part in enumerate(np.split(members, cuts)):
                shares[client].append(part)
                sizes[client] += len(part)
        if sizes.min() >= min_samples:
            break
    return [np.concatenate(parts) for parts in shares]


@register_partitioner("domain_dirichlet")
def _domain_dirichlet(request: PartitionRequest) -> list[np.ndarray]:
    """Each domain (a value of data.partition.column) goes to ``clients_per_domain`` clients, split among
    them by the labeldir rule; clients are numbered domain by domain, in sorted domain order."""
    labels, num_clients, groups = request.labels, request.num_clients, request.groups
    clients_per_domain, alpha = request.clients_per_domain, request.alpha
    min_samples, seed = request.min_samples, request.seed
    _require_alpha(alpha, "domain_dirichlet")
    if groups is None:
        raise DataError(
            "data.partition.column must name the domain column for data.partition.name = 'domain_dirichlet'."
        )
    domains = np.unique(groups)
    if clients_per_domain is None or clients_per_domain * len(domains) != num_clients:
        raise DataError(
            f"data.partition.clients_per_domain = {clients_per_domain} times the {len(domains)} domains must equal "
            f"data.num_clients = {num_clients}."
        )
    clients = []
    for index, domain in enumerate(domains):
        members = np.flatnonzero(groups == domain)
        rng = seeded_rng(seed, PURPOSE_LABELDIR, index)
        clients += _labeldir(members, labels, clients_per_domain, alpha, min_samples, rng)
    return clients
