"""What a task kind (:mod:`rayfed.tasks.kinds`) reads of a task and calls on a model, as protocols: rayfed.tasks and
rayfed.models build on task kinds (a Task holds its kind, a ClientModel runs its kinds' forward), so the kinds name
neither."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from rayfed.types import Batch


class HeadTask(Protocol):
    """What :meth:`rayfed.tasks.kinds.TaskKind.build_head` reads of a task (a :class:`rayfed.tasks.Task`)."""

    index: int
    name: str
    image_shape: tuple[int, int, int] | None
    num_choices: int

    @property
    def num_classes(self) -> int: ...


class TaskModel(Protocol):
    """What a task kind calls on the model it trains and scores (a :class:`rayfed.models.ClientModel`): the active
    task's outputs, the backbone's features, a causal LM's logits, and for generation whether it generates text,
    its generations (:class:`rayfed.TrainableModule` declares the defaults), tokenizer, encoder and image
    preprocessing."""

    head: nn.Module
    encoder: nn.Module
    tokenizer: Any
    generates_text: bool
    chat_template: bool

    def __call__(self, batch: Batch) -> torch.Tensor: ...

    def features(self, batch: Batch) -> torch.Tensor: ...

    def lm_logits(self, batch: Batch) -> torch.Tensor: ...

    def pixels(self, images: torch.Tensor) -> torch.Tensor: ...

    def generate_text(self, batch: Batch, max_new_tokens: int) -> torch.Tensor: ...

    def logits_and_generations(self, batch: Batch, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]: ...
