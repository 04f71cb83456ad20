"""What a client learns: a task of the run (a dataset's label space, or its text or images to produce),
its kind, and which parameters belong to which tasks."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from rayfed.tasks.kinds import Classification, TaskKind
from rayfed.param_names import task_key, task_of_name
from rayfed.seeding import SERVER, numpy_rng, sample_clients

if TYPE_CHECKING:
    from rayfed.config import DataConfig, RunConfig

T = TypeVar("T")


@dataclass(frozen=True)
class Task:
    """One task of a run: ``index`` in the run's task list, a name, its classes (classification), its
    kind, and what its kind needs to build a head (the target images' shape, the number of choices)."""

    index: int
    name: str
    class_names: tuple[str, ...] = ()
    kind: TaskKind = field(default_factory=Classification)
    image_shape: tuple[int, int, int] | None = None  # (C, H, W) of reconstructed images
    num_choices: int = 0
    modalities: frozenset[str] = frozenset()  # the inputs its data has ("image", "text"); empty: not recorded

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def param_tasks(name: str, tags: Mapping[str, frozenset[int]]) -> frozenset[int] | None:
    """The tasks parameter ``name`` belongs to: its tag, else its ``task_<index>`` component; None: shared."""
    if name in tags:
        return tags[name]
    task = task_of_name(name)
    return None if task is None else frozenset((task,))


def task_view(
    tensors: dict[str, T] | None, tasks: int | Collection[int], tags: Mapping[str, frozenset[int]] | None = None,
) -> dict[str, T] | None:
    """What a client of ``tasks`` holds of ``tensors``: the shared ones and its tasks' own."""
    if tensors is None:
        return None
    held = {tasks} if isinstance(tasks, int) else set(tasks)
    tags = tags or {}
    return {name: value for name, value in tensors.items()
            if (owners := param_tasks(name, tags)) is None or owners & held}


def client_tasks(data: DataConfig) -> list[tuple[int, ...]]:
    """The tasks of every client id, in task order: each of ``data.tasks`` holds the ids it lists in its
    ``clients``, else contiguous ids in task order."""
    if data.tasks is None:
        return [(0,)] * data.num_clients
    held: list[list[int]] = [[] for _ in range(data.num_clients)]
    for index, task in enumerate(data.tasks):
        for client in task_client_ids(data, index):
            held[client].append(index)
    return [tuple(tasks) for tasks in held]


def task_client_ids(data: DataConfig, task_index: int) -> list[int]:
    """The client ids of task ``task_index``: its ``clients``, else the next ``num_clients`` ids."""
    task = data.tasks[task_index]
    if task.clients is not None:
        return list(task.clients)
    start = sum(other.num_clients for other in data.tasks[:task_index])
    return list(range(start, start + task.num_clients))


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
