"""Split a labelled dataset into federated clients, and each client into train and test.

All functions are pure: the same inputs and seed give the same index arrays. Every random draw
uses its own stream ``np.random.SeedSequence([seed, purpose, ...])``, never the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rayfed.data.sources import DataError
from rayfed.registry import register_partitioner, resolve

_DIRICHLET_ATTEMPTS = 100

# Fixed stream ids, one per kind of random draw.
_PURPOSE_IID = 2001
_PURPOSE_DIRICHLET = 2002
_PURPOSE_SHARD_CLASSES = 2003
_PURPOSE_SHARD_SPLIT = 2004
_PURPOSE_SHARD_SUBSET = 2005
_PURPOSE_TRAIN_TEST = 2006
_PURPOSE_LABELDIR = 2007
_PURPOSE_GLOBAL_TEST = 2008
_PURPOSE_PRESPLIT = 2009


def _rng(seed: int, purpose: int, *extra: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, purpose, *extra]))


@dataclass(frozen=True)
class PartitionRequest:
    """What a partitioner is asked for: split the samples (by ``labels`` and/or ``groups``) into
    ``num_clients`` clients, with the partition config's fields as given."""

    labels: np.ndarray  # (N,) what the partitioners skew by: the class labels, or one stratum when there are none
    num_clients: int
    seed: int
    groups: np.ndarray | None = None  # (N,) the data.partition.column values, when set
    alpha: float | None = None
    classes_per_client: int | None = None
    samples_per_client: int | None = None
    clients_per_domain: int | None = None
    min_samples: int = 2
    test_fraction: float = 0.25  # data.test_fraction, for a partitioner that cuts train and test itself
    class_names: tuple[str, ...] = ()  # the dataset's classes, label id i named class_names[i]
    options: dict[str, Any] = field(default_factory=dict)  # data.partition.options, which the partitioner checks

    def rng(self, purpose: int, *extra: int) -> np.random.Generator:
        """A random stream of its own for one kind of draw."""
        return _rng(self.seed, purpose, *extra)


@dataclass(frozen=True)
class LabelSpace:
    """A task a partitioner makes of one dataset: its name and the dataset's label ids it holds, relabelled
    0..k-1 in this order."""

    name: str
    classes: tuple[int, ...]


@dataclass(frozen=True)
class SharedTest:
    """A test set every client is also scored on: sample ``indices``, in label space ``space`` (an index into
    :attr:`Partition.label_spaces`); with ``exclude_own_classes`` a client's own classes are left out of its score."""

    name: str
    indices: np.ndarray
    space: int = 0
    exclude_own_classes: bool = False


@dataclass(frozen=True)
class Partition:
    """What a partitioner may return instead of one index array per client: each client's (train, test) indices
    already cut, the label spaces (tasks of the run) the dataset's classes are cut into, every class in exactly one
    (none: the dataset's one label space), and test sets every client is also scored on."""

    splits: tuple[tuple[np.ndarray, np.ndarray], ...]
    label_spaces: tuple[LabelSpace, ...] = ()
    shared_tests: tuple[SharedTest, ...] = ()


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
    settings = "".join(f", {name} = {value}" for name, value in fields.items() if value is not None and name != "min_samples")
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


@register_partitioner("iid")
def _iid(request: PartitionRequest) -> list[np.ndarray]:
    """A seeded shuffle cut into equal parts."""
    order = request.rng(_PURPOSE_IID).permutation(len(request.labels))
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
    rng = _rng(seed, _PURPOSE_DIRICHLET)
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
    class_order = _rng(seed, _PURPOSE_SHARD_CLASSES).permutation(classes)
    client_classes = [
        [class_order[(client * classes_per_client + slot) % len(classes)] for slot in range(classes_per_client)]
        for client in range(num_clients)
    ]
    split_rng = _rng(seed, _PURPOSE_SHARD_SPLIT)
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

    subset_rng = _rng(seed, _PURPOSE_SHARD_SUBSET)
    clients = []
    for client, held in enumerate(client_classes):
        shards = [shard_of[client, int(label)] for label in held]
        if samples_per_client is not None:
            quotas = _balanced_quotas(samples_per_client, len(held))
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


def _balanced_quotas(total: int, parts: int) -> list[int]:
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
    parts = [np.array_split(request.rng(_PURPOSE_PRESPLIT, index).permutation(np.flatnonzero(splits == split)),
                            request.num_clients) for index, split in enumerate(("train", "test"))]
    return Partition(tuple((np.sort(train), np.sort(test)) for train, test in zip(*parts)))


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
        rng = _rng(seed, _PURPOSE_TRAIN_TEST, client)
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


@register_partitioner("labeldir")
def _labeldir_request(request: PartitionRequest) -> list[np.ndarray]:
    """Per class, Dir(alpha) proportions capped at an equal share per client (NIID-Bench's "noniid-labeldir")."""
    _require_alpha(request.alpha, "labeldir")
    return _labeldir(np.arange(len(request.labels)), request.labels, request.num_clients, request.alpha,
                     request.min_samples, request.rng(_PURPOSE_LABELDIR))


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
            proportions = proportions / proportions.sum() if proportions.sum() > 0 else np.full(num_clients, 1 / num_clients)
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
    clients_per_domain, alpha, min_samples, seed = request.clients_per_domain, request.alpha, request.min_samples, request.seed
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
        rng = _rng(seed, _PURPOSE_LABELDIR, index)
        clients += _labeldir(members, labels, clients_per_domain, alpha, min_samples, rng)
    return clients
def exact_test_split(
    client_indices: list[np.ndarray], labels: np.ndarray, test_samples: int, *, seed: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Split each client into exactly ``test_samples`` test samples, spread evenly over the client's
    classes (sorted, larger quotas first), and the rest for training; every class keeps >= 1 of each."""
    labels = np.asarray(labels)
    splits = []
    for client, indices in enumerate(client_indices):
        rng = _rng(seed, _PURPOSE_TRAIN_TEST, client)
        client_labels = labels[indices]
        classes = np.unique(client_labels)
        train_parts, test_parts = [], []
        for label, quota in zip(classes, _balanced_quotas(test_samples, len(classes))):
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


def global_test_indices(splits: list[tuple[np.ndarray, np.ndarray]], num_samples: int, size: int, *, seed: int) -> np.ndarray:
    """``size`` sample indices (sorted) drawn uniformly from the samples no client holds: a test set of the
    whole label distribution (a global accuracy)."""
    held = np.concatenate([np.concatenate(split) for split in splits]) if splits else np.array([], dtype=np.int64)
    free = np.setdiff1d(np.arange(num_samples), held)
    if size > len(free):
        raise DataError(
            f"data.partition.global_test_samples = {size} is more than the {len(free)} samples no client holds; "
            f"use at most {len(free)}, or load more samples."
        )
    return np.sort(_rng(seed, _PURPOSE_GLOBAL_TEST).choice(free, size=size, replace=False))
