"""What a client learns: a task is a label space (class names) that a client's data is labelled in."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from rayfed.seeding import SERVER, numpy_rng, sample_clients

if TYPE_CHECKING:
    from rayfed.config import DataConfig, RunConfig

T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    """One task of a run: ``index`` in the run's task list, a name, and the names of its classes."""

    index: int
    name: str
    class_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


_TASK_COMPONENT = re.compile(r"(?:^|\.)task_(\d+)(?:\.|$)")


def task_key(index: int) -> str:
    """The name component that marks a parameter as task ``index``'s own."""
    return f"task_{index}"


@functools.lru_cache(maxsize=None)  # asked for every tensor of every payload, every round
def task_of_name(name: str) -> int | None:
    """The task a parameter belongs to (its ``task_<index>`` component), or None for a shared one."""
    match = _TASK_COMPONENT.search(name)
    return int(match.group(1)) if match else None


def task_view(tensors: dict[str, T] | None, task_index: int) -> dict[str, T] | None:
    """What a client of task ``task_index`` holds of ``tensors``: the shared ones and its task's own."""
    if tensors is None:
        return None
    return {name: value for name, value in tensors.items() if task_of_name(name) in (None, task_index)}


def client_tasks(data: DataConfig) -> list[int]:
    """The task of every client id: tasks hold contiguous ids in the order of ``data.tasks``."""
    if data.tasks is None:
        return [0] * data.num_clients
    return [index for index, task in enumerate(data.tasks) for _ in range(task.num_clients)]


def sample_round(config: RunConfig, round_idx: int) -> list[int]:
    """The round's clients, sorted. With per-task ``clients_per_round`` (stratified sampling), each
    task samples its own clients from a stream of its own, so a task's draws do not depend on the
    other tasks; otherwise ``federation.clients_per_round`` clients uniformly over all."""
    data = config.data
    if data.tasks is None or data.tasks[0].clients_per_round is None:
        return sample_clients(config.seed, round_idx, data.num_clients, config.federation.clients_per_round)
    sampled, offset = [], 0
    for index, task in enumerate(data.tasks):
        if task.clients_per_round >= task.num_clients:
            chosen = range(task.num_clients)
        else:
            rng = numpy_rng(config.seed, round_idx, SERVER, f"sample_clients:{task_key(index)}")
            chosen = rng.choice(task.num_clients, size=task.clients_per_round, replace=False)
        sampled += [offset + int(c) for c in chosen]
        offset += task.num_clients
    return sorted(sampled)
