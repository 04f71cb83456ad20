"""What a partitioner (``data.partition.name``, a plug-in) is asked for and what it may return, and the random
streams of the data's splits: every draw uses its own stream ``np.random.SeedSequence([seed, purpose, ...])``, never
the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Fixed stream ids, one per kind of random draw.
PURPOSE_IID = 2001
PURPOSE_DIRICHLET = 2002
PURPOSE_SHARD_CLASSES = 2003
PURPOSE_SHARD_SPLIT = 2004
PURPOSE_SHARD_SUBSET = 2005
PURPOSE_TRAIN_TEST = 2006
PURPOSE_LABELDIR = 2007
PURPOSE_GLOBAL_TEST = 2008
PURPOSE_PRESPLIT = 2009


def seeded_rng(seed: int, purpose: int, *extra: int) -> np.random.Generator:
    """The random stream of one kind of draw (``purpose``, one of the ids above)."""
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
        return seeded_rng(self.seed, purpose, *extra)


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

