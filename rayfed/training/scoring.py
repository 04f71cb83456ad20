"""Scoring a model on test columns: a task kind's sums, batch by batch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from rayfed.data.batches import Columns, num_rows
from rayfed.training.precision import mixed_precision
from rayfed.models.peft.modules import select_task
from rayfed.tasks import Task
from rayfed.types import Batch

if TYPE_CHECKING:
    from rayfed.tasks.kinds import TaskKind


class Scorer:
    """Scores ``model`` (with the values loaded into it) on test columns of the run's ``tasks`` (by index), in batches
    of ``batch_size`` on ``device``, under ``train.autocast`` ``autocast``."""

    def __init__(self, model: nn.Module, tasks: Sequence[Task], device: torch.device, batch_size: int, autocast: str):
        self.model = model
        self.tasks = tasks
        self.device = device
        self.batch_size = batch_size
        self.autocast = autocast

    def score(self, task: Task, columns: Columns) -> tuple[dict[str, float], int]:
        """The task kind's sums over ``columns``, scored in batches of ``batch_size``, and the row count."""
        sums: dict[str, float] = {}
        for batch in self._test_batches(columns):
            with mixed_precision(self.device, self.autocast):
                scored = task.kind.score(self.model, batch)
            for name, value in scored.items():
                sums[name] = sums.get(name, 0.0) + value
        return sums, num_rows(columns)

    def score_tasks(self, items: Sequence[tuple[int, Columns]]) -> list[tuple[dict[str, float], int]]:
        """Each (task index, test columns)'s sums and row count. The test sets of tasks that the model runs through
        one forward and whose kind can merge them are scored as one set: one pass of batched generations for a
        client's every text-generation task, not one per task."""
        scored: dict[int, tuple[dict[str, float], int]] = {}
        by_kind: dict[type, list[int]] = {}
        for position, (task_index, _) in enumerate(items):
            by_kind.setdefault(type(self.tasks[task_index].kind), []).append(position)
        pad_token_id = getattr(getattr(self.model, "tokenizer", None), "pad_token_id", None)
        for positions in by_kind.values():
            task_indices = [items[position][0] for position in positions]
            kind = self.tasks[task_indices[0]].kind
            merged = None
            if len(positions) > 1 and self.model.shares_forward(task_indices):
                merged = kind.merge_columns([items[position][1] for position in positions], pad_token_id)
            if merged is None:
                for position, task_index in zip(positions, task_indices):
                    select_task(self.model, task_index)
                    scored[position] = self.score(self.tasks[task_index], items[position][1])
                continue
            select_task(self.model, task_indices[0])
            rows = self._score_rows(kind, merged)
            first = 0
            for position in positions:
                count = num_rows(items[position][1])
                scored[position] = ({name: float(values[first:first + count].sum()) for name, values in rows.items()},
                                    count)
                first += count
        return [scored[position] for position in range(len(items))]

    def _score_rows(self, kind: TaskKind, columns: Columns) -> dict[str, torch.Tensor]:
        """``kind``'s values of every row of ``columns``, scored in batches of ``batch_size`` (a value some
        batches lack is dropped)."""
        values: dict[str, list[torch.Tensor]] = {}
        batches = 0
        for batch in self._test_batches(columns):
            with mixed_precision(self.device, self.autocast):
                for name, rows in kind.score_rows(self.model, batch).items():
                    values.setdefault(name, []).append(rows)
            batches += 1
        return {name: torch.cat(parts) for name, parts in values.items() if len(parts) == batches}

    def _test_batches(self, columns: Columns) -> Iterator[Batch]:
        size = self.batch_size
        for start in range(0, num_rows(columns), size):
            yield {name: column[start:start + size].to(self.device) for name, column in columns.items()}

