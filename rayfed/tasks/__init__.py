"""What a client learns: the run's tasks and their kinds.

One job a module: ``task`` (:class:`Task`, which clients hold which tasks, which parameters are a task's own, the
round's sample of clients), ``kinds`` (the task kinds: a task's examples as tensors, its head, loss and metrics; a
plug-in kind, ``data.kind``; the base class in ``kind_base``, the built-ins in ``classification``,
``text_generation`` and ``reconstruction``), ``texts`` (the texts a kind encodes: prompts with their image tokens,
chat templates, target tokens, padded widths), ``kind_protocols`` (what a kind reads of a task and calls on a
model), ``decoders`` (heads that turn features back into an input modality) and ``text_metrics`` (scores of
generated text).
"""

from __future__ import annotations

from rayfed.tasks.task import (
    Task, client_tasks, param_tasks, sample_round, task_client_ids, task_key, task_of_name, task_view,
)

__all__ = ["Task", "client_tasks", "param_tasks", "sample_round", "task_client_ids", "task_key", "task_of_name",
           "task_view"]
