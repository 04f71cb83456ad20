"""One train call as a step plan runs it: its checked arguments (:class:`TrainCall`), what it gives back
(:class:`TrainResult`) and what every plan is (:class:`StepPlan`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rayfed import seeding
from rayfed.models.module_walks import named_parameter_table
from rayfed.tasks import Task
from rayfed.training.steps import Phase, StepClient, StepObserver
from rayfed.types import Batch, Loss, TensorDict


class PlanClient(StepClient, Protocol):
    """What a step plan reads of its client (:class:`rayfed.training.ClientContext`, which builds on the plans)."""

    client_id: int
    round: int
    seed: int

    @property
    def task(self) -> int: ...

    def batch_order(self, batches: int, purpose: str, pool: torch.Tensor | None) -> Iterator[torch.Tensor]: ...

    def micro_batch(self, indices: torch.Tensor) -> list[tuple[Task, Batch]]: ...


@dataclass
class TrainResult:
    params: TensorDict
    loss: Loss  # mean training loss over the steps taken (the first phase's), left on the device
    task_losses: dict[int, Loss] = field(default_factory=dict)  # per task: mean loss over the micro-batches holding it
    optimizer_state: TensorDict | None = None  # with keep_optimizer_state: to pass back in a later call
    snapshots: dict[int, TensorDict] = field(default_factory=dict)  # with snapshot_steps: params after those steps


@dataclass(frozen=True)
class TrainCall:
    """A train call's arguments, checked and with their defaults filled in (:meth:`ClientContext.train
    <rayfed.training.ClientContext.train>`)."""

    params: TensorDict
    steps: int
    purpose: str
    lr: float  # the base rate: the call's, else the config's
    phases: Sequence[Phase]
    plain: bool  # neither a loss nor phases given: the task loss, optionally plus the one phase's extra_loss
    optimizer_state: TensorDict | None
    keep_optimizer_state: bool
    snapshot_steps: Sequence[int]
    pool: torch.Tensor | None  # the rows it may draw from (ClientContext.arrived_rows; None: all)
    observe: StepObserver | None = None  # each micro-batch, once its step is taken, eagerly

    def simple(self, client: PlanClient) -> bool:
        """One task, one micro-batch a step, a fresh optimizer: what a captured or a stacked step can run."""
        return (len(client.data.parts) == 1 and client.train_config.grad_accum == 1
                and self.optimizer_state is None and not self.keep_optimizer_state)

    @property
    def has_rows(self) -> bool:
        """Whether there is anything to train on (in a stream, nothing may have arrived yet)."""
        return self.pool is None or len(self.pool) > 0

    def batches(self, client: PlanClient) -> int:
        """How many micro-batches the call draws."""
        return self.steps * client.train_config.grad_accum


class StepPlan(Protocol):
    """How a train call's steps run (eager, a captured graph, the captured graphs of its parts, stacked with other
    clients'): what :meth:`ClientContext.train <rayfed.training.ClientContext.train>` hands a checked call to. A plan
    is kept with its model and owns what it keeps across calls (its graphs, compiled steps)."""

    def run(self, client: PlanClient, call: TrainCall) -> TrainResult: ...


def trained_tensors(client: PlanClient, call: TrainCall) -> dict[str, torch.Tensor]:
    """The model's live tensors the call trains, loaded with the call's values, the model in training mode."""
    client.model.load_trainable(call.params)
    named = {name: p for name, p in named_parameter_table(client.model).items() if name in call.params}
    client.model.train()
    return named


def seed_dropout(client: PlanClient, call: TrainCall) -> None:
    """Seed the dropout draws of the call's steps by (round, client, purpose)."""
    torch.manual_seed(seeding.torch_seed(client.seed, client.round, client.client_id, call.purpose + ":dropout"))


def copied(named: dict[str, torch.Tensor]) -> TensorDict:
    return {n: p.detach().clone() for n, p in named.items()}
