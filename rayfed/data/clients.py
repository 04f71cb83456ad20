"""From a data config to per-client datasets: load the source, partition, split train/test."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from rayfed.config import DataConfig
from rayfed.data.base_novel import base_novel_split
from rayfed.data.partition import partition, split_train_test
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


def build_federation(config: DataConfig, seed: int) -> Federation:
    """Deterministic in (config, seed): every actor that calls it gets the same clients."""
    dataset = load_source(
        config.source, path=config.path, split=config.split, image_column=config.image_column,
        label_column=config.label_column, group_column=config.partition.column,
        max_samples=config.max_samples, seed=seed, synthetic=config.synthetic, resize=config.resize,
    )
    if config.base_novel is not None:
        relabelled, splits, tasks, shared_eval = base_novel_split(
            dataset, config.num_clients, config.base_novel, config.test_fraction, seed
        )
        return Federation(relabelled, splits, tasks, shared_eval)
    part = config.partition
    client_indices = partition(
        dataset.labels, config.num_clients, part.name, seed=seed, alpha=part.alpha,
        classes_per_client=part.classes_per_client, groups=dataset.groups,
        min_samples=part.min_samples, samples_per_client=part.samples_per_client,
        clients_per_domain=part.clients_per_domain,
    )
    return Federation(dataset, split_train_test(client_indices, dataset.labels, config.test_fraction, seed=seed))
