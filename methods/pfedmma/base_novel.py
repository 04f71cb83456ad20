"""Base-to-novel federated splits of pFedMMA (*pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for
Vision-Language Models*; docs/pfedmma.md#data-and-metrics), the partitioner ``data.partition: {name: base_novel}``.

The classes, sorted by label id, are cut in two: the first ceil(C/2) are *base* classes, the rest
*novel*; each half is one label space (task) of the run, relabelled 0..k-1. The base classes
are shuffled with a fixed seed and dealt to clients in contiguous chunks of round(B/N) classes, the last
client taking the remainder ("pathological" split, no overlap). A client trains on K shots of each of its
classes and is tested on all test images of its classes, over all B base classes. Every client is also
scored on the whole base test split (B-way) and the whole novel test split (novel-way).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfed.data.partition import LabelSpace, Partition, PartitionRequest, SharedTest, split_train_test
from rayfed.data.sources import DataError
from rayfed.errors import suggest
from rayfed.compat import register_moved_field
from rayfed.registry import register_partitioner

_PURPOSE_SHOTS = 0xBA5E
_UNUSED_FIELDS = ("alpha", "classes_per_client", "samples_per_client", "clients_per_domain")


@dataclass(frozen=True)
class BaseNovelOptions:
    """``data.partition.options`` of ``base_novel``."""

    shots: int = 16  # training images per class on each client
    class_seed: int = 2023  # seed of the shuffle that deals base classes to clients
    base_excludes_local: bool = False  # base_acc leaves out the client's own classes

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> BaseNovelOptions:
        """The options over their defaults; an unknown key or a value of the wrong type is one sentence."""
        known = [field.name for field in dataclasses.fields(cls)]
        for key in options:
            if key not in known:
                raise DataError(f"data.partition.options has no option {key!r}{suggest(key, known)} for "
                                f"data.partition.name = 'base_novel'; allowed: {', '.join(known)}.")
        chosen = cls(**options)
        for key, allowed, valid in (("shots", "an integer >= 1", _is_int(chosen.shots) and chosen.shots >= 1),
                                    ("class_seed", "an integer", _is_int(chosen.class_seed)),
                                    ("base_excludes_local", "true or false",
                                     isinstance(chosen.base_excludes_local, bool))):
            if not valid:
                raise DataError(f"data.partition.options.{key} = {getattr(chosen, key)!r} is invalid: "
                                f"it must be {allowed}.")
        return chosen


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


register_moved_field("data.base_novel", "data.base_novel is now a partitioner: write data.partition: "
                     "{name: base_novel, options: {shots, class_seed, base_excludes_local}} instead "
                     "(docs/pfedmma.md#data-and-metrics)")


@register_partitioner("base_novel")
def base_novel(request: PartitionRequest) -> Partition:
    """pFedMMA's base-to-novel split: clients hold K shots of chunks of the base classes; base and novel are scored
    on every client."""
    for name in _UNUSED_FIELDS:
        if getattr(request, name) is not None:
            raise DataError(f"data.partition.{name} is not used by data.partition.name = 'base_novel', which deals "
                            "the base classes to clients itself; remove it.")
    return base_novel_split(request.labels, request.class_names, request.num_clients,
                            BaseNovelOptions.from_options(request.options), request.test_fraction, request.seed)


def base_novel_split(
    labels: np.ndarray, class_names: tuple[str, ...], num_clients: int, options: BaseNovelOptions, test_fraction: float,
    seed: int,
) -> Partition:
    """Per-client (train, test) indices, the (base, novel) label spaces and the two shared test sets.

    The pooled dataset is first split into train and test per class (``test_fraction``, stratified).
    """
    num_classes = len(class_names)
    num_base = math.ceil(num_classes / 2)
    if num_classes < 2:
        raise DataError(f"data.partition.name = 'base_novel' needs at least 2 classes; data.source has {num_classes}.")
    chunk = round(num_base / num_clients)
    if chunk == 0 or chunk * (num_clients - 1) >= num_base:
        raise DataError(
            f"data.partition.name = 'base_novel': {num_base} base classes cannot be dealt in chunks of "
            f"round({num_base}/{num_clients}) to data.num_clients = {num_clients} with the last client keeping "
            "at least one; use fewer clients."
        )
    (train, test), = split_train_test([np.arange(len(labels))], labels, test_fraction, seed=seed)
    order = np.random.default_rng(options.class_seed).permutation(num_base)
    chunks = [order[i * chunk:(i + 1) * chunk] for i in range(num_clients - 1)] + [order[(num_clients - 1) * chunk:]]
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SHOTS]))
    splits = []
    for client, classes in enumerate(chunks):
        shots = []
        for label in np.sort(classes):
            members = train[labels[train] == label]
            if len(members) < options.shots:
                raise DataError(
                    f"data.partition.options.shots = {options.shots} but class {class_names[label]!r} "
                    f"(client {client}) has only {len(members)} training samples; lower data.partition.options.shots."
                )
            shots.append(rng.choice(members, size=options.shots, replace=False))
        own_test = test[np.isin(labels[test], classes)]
        splits.append((np.sort(np.concatenate(shots)), own_test))
    is_base = labels < num_base
    spaces = (LabelSpace("base", tuple(range(num_base))), LabelSpace("novel", tuple(range(num_base, num_classes))))
    shared = (SharedTest("base", test[is_base[test]], 0, options.base_excludes_local),
              SharedTest("novel", test[~is_base[test]], 1))
    return Partition(tuple(splits), spaces, shared)
