"""Clients whose data arrives over time (``data.stream``: tasks arriving all at once, one after another, or
asynchronously).

A client's tasks (in task order) arrive one after another, each in a window of rounds: ``dynamic`` gives
every task ``rounds_per_task`` rounds, ``asynchronous`` draws one of ``patterns`` per client (seeded),
``static`` makes everything available at round 0. Within its window a task's training samples arrive in
equal seeded chunks, one per round (``gradual``), or all at its start. Local training at round r draws
its batches from the samples that have arrived: all of them (no ``memory``), or the samples arriving in
round r plus an episodic memory of ``memory`` earlier ones (a seeded reservoir over the arrival order,
or an equal quota per task seen). A task is *seen* once its window has started; evaluation covers the
tasks seen so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rayfed.config import StreamConfig
from rayfed.seeding import numpy_rng


@dataclass(frozen=True)
class Window:
    """The rounds in which one of a client's tasks arrives: ``start`` .. ``start + length - 1``."""

    start: int
    length: int


def task_windows(stream: StreamConfig, seed: int, client_id: int, num_tasks: int) -> list[Window]:
    """The arrival window of each of a client's tasks, in task order."""
    if stream.mode == "static":
        return [Window(0, 1)] * num_tasks
    if stream.mode == "dynamic":
        lengths = [stream.rounds_per_task] * num_tasks
    else:
        rng = numpy_rng(seed, 0, client_id, "stream:pattern")
        pattern = stream.patterns[int(rng.integers(len(stream.patterns)))]
        lengths = [pattern[k % len(pattern)] for k in range(num_tasks)]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
    return [Window(int(start), int(length)) for start, length in zip(starts, lengths)]


def arrival_rounds(stream: StreamConfig, seed: int, client_id: int, task: int, window: Window,
                   num_samples: int) -> np.ndarray:
    """The round each of a task's training samples arrives in (int64, one per sample)."""
    if not stream.gradual or window.length == 1:
        return np.full(num_samples, window.start, dtype=np.int64)
    order = numpy_rng(seed, 0, client_id, f"stream:order:{task}").permutation(num_samples)
    arrival = np.empty(num_samples, dtype=np.int64)
    for chunk, rows in enumerate(np.array_split(order, window.length)):
        arrival[rows] = window.start + chunk
    return arrival


def training_pool(stream: StreamConfig, seed: int, client_id: int, round_idx: int, arrival: np.ndarray,
                  task_of_row: np.ndarray) -> np.ndarray:
    """The rows (of the client's training samples, all tasks concatenated) local training may draw from in
    round ``round_idx``: what has arrived, or this round's arrivals plus the episodic memory."""
    arrived = np.flatnonzero(arrival <= round_idx)
    if stream.memory is None:
        return arrived
    new = np.flatnonzero(arrival == round_idx)
    earlier = np.flatnonzero(arrival < round_idx)
    earlier = earlier[np.argsort(arrival[earlier], kind="stable")]  # in arrival order
    if stream.memory_policy == "reservoir":
        memory = _reservoir(earlier, stream.memory, numpy_rng(seed, 0, client_id, "stream:reservoir"))
    else:
        memory = _per_task_quota(earlier, task_of_row, stream.memory, numpy_rng(seed, round_idx, client_id,
                                                                                  "stream:quota"))
    return np.union1d(new, memory)


def _reservoir(stream_rows: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """Algorithm R over ``stream_rows`` in order: a uniform sample of ``size`` of them, the same prefix
    always giving the same memory (the generator's draws follow the stream position)."""
    memory = list(stream_rows[:size])
    draws = rng.random(max(len(stream_rows), 1))
    for position in range(size, len(stream_rows)):
        slot = int(draws[position] * (position + 1))
        if slot < size:
            memory[slot] = stream_rows[position]
    return np.asarray(memory, dtype=np.int64)


def _per_task_quota(rows: np.ndarray, task_of_row: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """An equal share of ``size`` for every task among ``rows``, drawn from that task's rows."""
    tasks = sorted(set(task_of_row[rows].tolist()))
    kept = []
    for task, quota in zip(tasks, np.array_split(np.arange(size), len(tasks)) if tasks else []):
        members = rows[task_of_row[rows] == task]
        kept.append(rng.choice(members, size=min(len(quota), len(members)), replace=False))
    return np.sort(np.concatenate(kept)) if kept else np.empty(0, np.int64)


def seen_round(eval_round: int) -> int:
    """The last round index whose arrivals count as seen at an evaluation after ``eval_round`` rounds."""
    return max(eval_round - 1, 0)


def area_under_curve(points: Sequence[float]) -> float:
    """A_AUC: the mean of a metric over the evaluation points (equally spaced rounds)."""
    return float(np.mean(points)) if len(points) else float("nan")
