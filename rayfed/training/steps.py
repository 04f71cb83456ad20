"""One step of a train call as a loss function sees it (:class:`Step`, its :class:`Phase`), whichever step plan runs
it (:mod:`rayfed.training.plans`), and a step's learning rate (:func:`step_lr`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rayfed.config import TrainConfig
from rayfed.data.batches import ClientData, TaskData, num_rows
from rayfed.models.client import TrainableModule
from rayfed.models.module_walks import functional_forward
from rayfed.models.peft.modules import select_task
from rayfed.tasks import Task
from rayfed.training.compiled_forward import trained_forward
from rayfed.training.optimizers import scheduled_lr
from rayfed.types import Batch, TensorDict


class StepClient(Protocol):
    """What a step reads of its client (:class:`rayfed.training.ClientContext`, which builds on this module)."""

    model: TrainableModule
    train_config: TrainConfig
    device: torch.device
    data: ClientData
    tasks: list[Task]

    def part_batch(self, part: TaskData, rows: torch.Tensor) -> Batch: ...


# An extra loss term computed from the live trainable parameters (e.g. a proximal term); a TensorPenalty is one a
# CUDA graph may capture with the step.
Penalty = Callable[[dict[str, torch.Tensor]], torch.Tensor]
LossFn = Callable[["Step"], torch.Tensor]
# Sees each micro-batch once its step is taken (ClientContext.train's ``observe``): eager work outside the step.
StepObserver = Callable[["Step"], None]


@dataclass(frozen=True)
class Phase:
    """One optimizer step per batch: the parameters it updates (``trains``: names, a predicate, or None for
    every trained parameter), the loss it minimises (None: the task loss), and its learning rate(s)."""

    trains: Collection[str] | Callable[[str], bool] | None = None
    loss: LossFn | None = None
    lr: float | None = None
    lr_of: Callable[[str], float | None] | None = None  # a parameter's own lr (None: the phase's)
    extra_loss: Penalty | None = None

    def selects(self, name: str) -> bool:
        if self.trains is None:
            return True
        return self.trains(name) if callable(self.trains) else name in self.trains


class Step:
    """What a loss function sees for one micro-batch: the batch (per task, for a client holding several),
    the model with the values being trained, and ways to run it."""

    def __init__(self, client: StepClient, parts: list[tuple[Task, Batch]], named: dict[str, torch.Tensor],
                 phase: int, index: int, memory: dict):
        self.client = client
        self.model = client.model
        self.parts = parts
        self.params = named  # the live trained tensors, by name
        self.phase = phase
        self.index = index  # the optimizer step's number in this call
        self.memory = memory  # shared by the phases of one micro-batch (e.g. a logit from phase 0 for phase 1)

    @property
    def task(self) -> Task:
        """The task of a single-task batch."""
        return self._single()[0]

    @property
    def batch(self) -> Batch:
        """The named columns of a single-task batch."""
        return self._single()[1]

    def _single(self) -> tuple[Task, Batch]:
        if len(self.parts) != 1:
            raise ValueError(f"this batch holds {len(self.parts)} tasks; use Step.parts")
        return self.parts[0]

    def outputs(self, part: int = 0) -> torch.Tensor:
        """The model's outputs on ``parts[part]``, with the values being trained."""
        task, batch = self.parts[part]
        select_task(self.model, task.index)
        return trained_forward(self.model, self.client.train_config)(batch)

    def raw_and_scored(self, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's outputs on ``parts[part]`` as distillation compares them and as the task's kind scores them
        (:meth:`rayfed.models.TrainableModule.raw_and_scored`), with the values being trained."""
        task, batch = self.parts[part]
        select_task(self.model, task.index)
        return self.model.raw_and_scored(batch, trained_forward(self.model, self.client.train_config))

    def forward(self, params: TensorDict, part: int = 0) -> torch.Tensor:
        """The model's outputs on ``parts[part]`` with ``params`` in place of the live values of those
        parameters (a frozen teacher, the received global model); no gradient reaches ``params``."""
        task, batch = self.parts[part]
        select_task(self.model, task.index)
        with torch.no_grad():
            return functional_forward(self.model, params, batch)

    def part_losses(self, outputs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Each task's own loss on its part of the batch (from ``outputs``, else a forward of each part, or one
        forward of the parts stacked where the model runs their tasks through the same forward)."""
        if outputs is None:
            outputs = self._stacked_outputs() or [self.outputs(i) for i in range(len(self.parts))]
        return [task.kind.loss(out, batch) for (task, batch), out in zip(self.parts, outputs)]

    def _stacked_outputs(self) -> list[torch.Tensor] | None:
        stacked = stacked_forward_batch(self.model, self.parts)
        if stacked is None:
            return None
        select_task(self.model, self.parts[0][0].index)
        outputs = trained_forward(self.model, self.client.train_config)(stacked)
        return list(outputs.split([num_rows(batch) for _, batch in self.parts]))

    def task_loss(self, losses: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """``sum_o lambda_o loss_o`` over the batch's tasks (lambda_o: task o's share of the samples)."""
        losses = list(losses) if losses is not None else self.part_losses()
        if len(losses) == 1:
            return losses[0]
        total = sum(num_rows(batch) for _, batch in self.parts)
        return sum(loss * (num_rows(batch) / total) for loss, (_, batch) in zip(losses, self.parts))


def stacked_forward_batch(model: TrainableModule, parts: Sequence[tuple[Task, Batch]]) -> Batch | None:
    """The parts' forward inputs (:attr:`~rayfed.tasks.kinds.TaskKind.forward_inputs`) stacked into one batch, when the
    model runs all their tasks through one forward (``shares_forward``) and the inputs agree past the rows; else
    None. A client holding several tasks then trains each step with one forward and one backward, not one per task."""
    if len(parts) < 2 or not model.shares_forward([task.index for task, _ in parts]):
        return None
    names = parts[0][0].kind.forward_inputs
    batches = [{name: column for name, column in batch.items() if names is None or name in names} for _, batch in parts]
    first = batches[0]
    if any(batch.keys() != first.keys() or any(
            batch[name].shape[1:] != first[name].shape[1:] or batch[name].dtype != first[name].dtype for name in first)
           for batch in batches):
        return None
    return {name: torch.cat([batch[name] for batch in batches]) for name in first}


class RecordedTaskLoss(ABC):
    """A loss function that is the task loss and also sees each micro-batch's per-task losses (a method's loss
    history over the call). Unlike any other loss function, a captured CUDA graph may run it: the graph computes
    the task loss, and :meth:`record` gets each replay's losses. ``record`` must only keep what it is given
    (detached tensors, which it may sum); it is not part of the backward."""

    def __call__(self, step: Step) -> torch.Tensor:
        losses = step.part_losses()
        self.record(step, losses)
        return step.task_loss(losses)

    @abstractmethod
    def record(self, step: Step, losses: Sequence[torch.Tensor]) -> None:
        """Keep the losses of ``step``'s parts, in the order of ``step.parts``."""


@dataclass(frozen=True)
class CapturedLoss:
    """A method's own loss that a CUDA graph may capture with its step (``train.cuda_graphs``), where a plain
    function runs the step eagerly. The method vouches that ``loss`` is tensor work on the step's batch, the model's
    live parameters and the step's memory alone, with no value read back to the host and no branch on one, and that
    it does not read :attr:`Step.index`; everything else it reads (a weight, a temperature, which adapters mix) is
    the same for every call with the same ``key``, which the graph's key holds: one graph serves every client and
    round whose loss has the same key."""

    loss: LossFn
    key: Hashable

    def __call__(self, step: Step) -> torch.Tensor:
        return self.loss(step)


def step_lr(config: TrainConfig, base_lr: float, round_idx: int, steps: int, step: int, purpose: str) -> float:
    """The learning rate of step ``step`` (of ``steps``) of a train call at ``base_lr``: on ``train.schedule`` for
    a client's local update (purpose ``train``), else ``base_lr`` throughout."""
    if config.schedule == "constant" or purpose != "train":
        return base_lr
    return scheduled_lr(config, base_lr, round_idx, round_idx * steps + step)
