"""From a data config to per-client datasets: load the source, partition, split train/test."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from rayfed.config import DataConfig
from rayfed.data.base_novel import base_novel_split
from rayfed.data.partition import exact_test_split, global_test_indices, partition, split_train_test
from rayfed.data.sources import ArrayDataset, load_source
from rayfed.models import Backbone, check_image_channels, to_tensor_images
from rayfed.tasks import Task
from rayfed.training import ClientData, EvalSet


@dataclass(frozen=True)
class Federation:
    """The pooled dataset and, for every client, its (train, test) sample indices."""

    dataset: ArrayDataset
    splits: list[tuple[np.ndarray, np.ndarray]]
    label_spaces: tuple[Task, ...] = ()  # default: one task over all of the dataset's classes
    shared_eval: Mapping[str, tuple[np.ndarray, int, bool]] = field(default_factory=dict)  # name -> (indices, task, exclude own)

    @property
    def tasks(self) -> list[Task]:
        return list(self.label_spaces) or [Task(0, "task", self.dataset.class_names)]

    def eval_sets(self, backbone: Backbone) -> list[EvalSet]:
        """The test sets every client is also scored on; an actor loads them once for all its clients."""
        check_image_channels(self.dataset.images.shape[-1], backbone)
        labels = torch.as_tensor(self.dataset.labels, dtype=torch.long)
        return [
            EvalSet(name, to_tensor_images(self.dataset.images[indices]), labels[indices], task, exclude_own)
            for name, (indices, task, exclude_own) in self.shared_eval.items()
        ]

    def task_of(self, client_id: int) -> int:
        return 0

    @property
    def num_clients(self) -> int:
        return len(self.splits)

    def sizes(self, client_id: int) -> dict[str, int]:
        train, test = self.splits[client_id]
        return {"num_train": len(train), "num_test": len(test)}

    def client_data(self, client_id: int, backbone: Backbone) -> ClientData:
        check_image_channels(self.dataset.images.shape[-1], backbone)
        train, test = self.splits[client_id]
        labels = torch.as_tensor(self.dataset.labels, dtype=torch.long)
        return ClientData(
            train_x=to_tensor_images(self.dataset.images[train]),
            train_y=labels[train],
            test_x=to_tensor_images(self.dataset.images[test]),
            test_y=labels[test],
        )


@dataclass(frozen=True)
class MultiTaskFederation:
    """Several tasks, each a :class:`Federation` of its own; client ids are contiguous in task order."""

    parts: list[Federation]
    names: list[str]

    @property
    def tasks(self) -> list[Task]:
        return [Task(index, name, part.dataset.class_names) for index, (name, part) in enumerate(zip(self.names, self.parts))]

    @property
    def num_clients(self) -> int:
        return sum(part.num_clients for part in self.parts)

    def _locate(self, client_id: int) -> tuple[int, int]:
        for index, part in enumerate(self.parts):
            if client_id < part.num_clients:
                return index, client_id
            client_id -= part.num_clients
        raise IndexError(f"client {client_id} is beyond the federation's {self.num_clients} clients")

    def task_of(self, client_id: int) -> int:
        return self._locate(client_id)[0]

    def sizes(self, client_id: int) -> dict[str, int]:
        task, local = self._locate(client_id)
        return self.parts[task].sizes(local)

    def client_data(self, client_id: int, backbone: Backbone) -> ClientData:
        task, local = self._locate(client_id)
        return self.parts[task].client_data(local, backbone)

    def eval_sets(self, backbone: Backbone) -> list[EvalSet]:
        """Every task's shared test sets, named ``<task>_<name>`` and scored in that task's label space."""
        return [
            dataclasses.replace(eval_set, name=f"{name}_{eval_set.name}", task=index)
            for index, (name, part) in enumerate(zip(self.names, self.parts))
            for eval_set in part.eval_sets(backbone)
        ]


def build_federation(config: DataConfig, seed: int) -> Federation | MultiTaskFederation:
    """Deterministic in (config, seed): every actor that calls it gets the same clients.

    With ``data.tasks`` every task's clients are built from its own config alone, so a task's data
    does not depend on which other tasks exist."""
    if config.tasks is not None:
        return MultiTaskFederation([build_federation(task, seed) for task in config.tasks], [t.name for t in config.tasks])
    dataset = load_source(
        config.source, path=config.path, split=config.split, image_column=config.image_column,
        label_column=config.label_column, group_column=config.partition.column,
        max_samples=config.max_samples, seed=seed, synthetic=config.synthetic, resize=config.resize,
        group_size=(1, None) if config.partition.max_group_size is None else
        (config.partition.min_samples, config.partition.max_group_size),
    )
    if config.base_novel is not None:
        relabelled, splits, tasks, shared_eval = base_novel_split(
            dataset, config.num_clients, config.base_novel, config.test_fraction, seed
        )
        return Federation(relabelled, splits, tasks, shared_eval)
    part = config.partition
    test_samples = part.test_samples_per_client
    total_per_client = None if part.samples_per_client is None else part.samples_per_client + (test_samples or 0)
    client_indices = partition(
        dataset.labels, config.num_clients, part.name, seed=seed, alpha=part.alpha,
        classes_per_client=part.classes_per_client, groups=dataset.groups,
        min_samples=part.min_samples, samples_per_client=total_per_client,
        clients_per_domain=part.clients_per_domain,
    )
    if test_samples is not None:
        splits = exact_test_split(client_indices, dataset.labels, test_samples, seed=seed)
    else:
        splits = split_train_test(client_indices, dataset.labels, config.test_fraction, seed=seed)
    if part.global_test_samples is None:
        return Federation(dataset, splits)
    indices = global_test_indices(splits, len(dataset), part.global_test_samples, seed=seed)
    return Federation(dataset, splits, shared_eval={"global": (indices, 0, False)})
