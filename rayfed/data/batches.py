"""A client's examples as named tensors, per task, where its actor keeps them.

``Columns`` are named tensors with one row per sample: ``pixel_values`` (raw (N, C, H, W) images in [0, 1];
the model resizes and normalizes them; (N, K, C, H, W) where a sample has several images, with their number in
``image_counts``, the rest zero), ``input_ids`` / ``attention_mask``, ``labels``, ``target_pixels``,
and per-sample metadata such as ``domain`` or ``arrival`` (the round a sample becomes available).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rayfed.types import tensor_bytes

Columns = dict[str, torch.Tensor]


def num_rows(columns: Columns) -> int:
    return len(next(iter(columns.values())))


def take(columns: Columns, indices: torch.Tensor | slice) -> Columns:
    """The rows ``indices`` of every column."""
    return {name: column[indices] for name, column in columns.items()}


def resident(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; on the host, in pinned memory when a GPU will read it (asynchronous copies)."""
    if device.type == "cpu" and torch.cuda.is_available():
        return tensor.pin_memory()
    return tensor.to(device)


def to_device(columns: Columns, device: torch.device) -> Columns:
    return {name: resident(column, device) for name, column in columns.items()}


@dataclass
class TaskData:
    """A client's train and test examples of one task (``task``: its index in the run's task list), and in a
    stream the round each training example arrives in and the task's first round."""

    task: int
    train: Columns
    test: Columns
    arrival: np.ndarray | None = None
    first_round: int = 0


@dataclass
class ClientData:
    """A client's examples, one :class:`TaskData` per task it holds, in task order."""

    parts: list[TaskData]

    @property
    def tasks(self) -> list[int]:
        return [part.task for part in self.parts]

    @property
    def num_train(self) -> int:
        return sum(num_rows(part.train) for part in self.parts)

    @property
    def num_test(self) -> int:
        return sum(num_rows(part.test) for part in self.parts)

    @property
    def nbytes(self) -> int:
        """The bytes of every part's train and test tensors."""
        return sum(tensor_bytes(part.train) + tensor_bytes(part.test) for part in self.parts)

    def part(self, task: int) -> TaskData:
        return next(part for part in self.parts if part.task == task)

    def to(self, device: torch.device) -> ClientData:
        return ClientData([dataclasses.replace(p, train=to_device(p.train, device), test=to_device(p.test, device))
                           for p in self.parts])

    @property
    def arrival(self) -> np.ndarray | None:
        """The arrival round of every training row, tasks concatenated (None: not a stream)."""
        if self.parts[0].arrival is None:
            return None
        return np.concatenate([part.arrival for part in self.parts])

    @property
    def task_of_row(self) -> np.ndarray:
        return np.concatenate([np.full(num_rows(part.train), part.task) for part in self.parts])

    def split(self, indices: torch.Tensor) -> Iterator[tuple[TaskData, torch.Tensor]]:
        """Indices into the concatenation of the tasks' training rows, as (task, rows of that task) pairs."""
        if len(self.parts) == 1:
            yield self.parts[0], indices
            return
        start = 0
        for part in self.parts:
            end = start + num_rows(part.train)
            chosen = indices[(indices >= start) & (indices < end)] - start
            if len(chosen):
                yield part, chosen
            start = end


@dataclass
class EvalSet:
    """Test data every client is scored on with its own model (e.g. the base or novel classes), loaded once
    per actor: ``{name}_<metric>`` is scored in the run's task ``task``."""

    name: str
    columns: Columns
    task: int
    exclude_own_classes: bool = False  # leave out the classes the client trains on

    def to(self, device: torch.device) -> EvalSet:
        return dataclasses.replace(self, columns=to_device(self.columns, device))
