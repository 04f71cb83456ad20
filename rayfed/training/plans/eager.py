"""The eager plan: each step's forwards and backwards run as written, then each phase's optimizer steps. Every train
call can run so; the graphed parts plan runs this loop with its replays for the forwards and backwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from rayfed.tasks import Task
from rayfed.training.optimizers import build_optimizer, load_optimizer_state, saved_optimizer_state
from rayfed.training.plans.call import PlanClient, TrainCall, TrainResult, copied, seed_dropout, trained_tensors
from rayfed.training.precision import mixed_precision
from rayfed.training.steps import Phase, Step, step_lr
from rayfed.types import Batch, TensorDict

# One phase's forwards and backwards over one step's micro-batches, as :func:`eager_pass` takes and gives them
Passes = Callable[[PlanClient, Phase, int, list[list[tuple[Task, Batch]]], list[dict], dict[str, torch.Tensor],
                   int, dict[int, torch.Tensor], dict[int, int]], list[torch.Tensor]]


class EagerPlan:
    """Runs any train call eagerly; it keeps nothing across calls."""

    def run(self, client: PlanClient, call: TrainCall) -> TrainResult:
        named = trained_tensors(client, call)
        return run_steps(client, call, named, client.batch_order(call.batches(client), call.purpose, call.pool))


def run_steps(client: PlanClient, call: TrainCall, named: dict[str, torch.Tensor],
              batches: Iterator[torch.Tensor], passes: Passes | None = None) -> TrainResult:
    """The call's optimizer steps over ``batches`` (the rows of each micro-batch), each phase's forwards and backwards
    run by ``passes`` (default: :func:`eager_pass`)."""
    config, steps = client.train_config, call.steps
    seed_dropout(client, call)
    snapshots: dict[int, TensorDict] = {}

    def snapshot(taken: int) -> None:
        if taken in call.snapshot_steps:
            snapshots[taken] = copied(named)

    if not call.has_rows:  # nothing has arrived yet
        for taken in call.snapshot_steps:
            snapshot(taken)
        return TrainResult(copied(named), float("nan"), snapshots=snapshots)
    # Summed on the device: reading each step's loss would make the host wait for the GPU every step.
    total_loss = torch.zeros((), device=client.device)
    optimizers = [phase_optimizer(client, phase, named, call.lr) for phase in call.phases]
    if call.optimizer_state is not None:
        load_optimizer_state(optimizers, named, call.optimizer_state)
    task_sums: dict[int, torch.Tensor] = {}
    task_counts: dict[int, int] = {}
    for step in range(steps):
        if config.schedule != "constant" and call.purpose == "train":
            for optimizer in optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = step_lr(config, group["base_lr"], client.round, steps, step, call.purpose)
        micro_batches = [client.micro_batch(next(batches)) for _ in range(config.grad_accum)]
        memories: list[dict] = [{} for _ in micro_batches]
        for index, (phase, optimizer) in enumerate(zip(call.phases, optimizers)):
            optimizer.zero_grad(set_to_none=True)
            values = (passes or eager_pass)(client, phase, index, micro_batches, memories, named, step, task_sums,
                                            task_counts)
            if index == 0:
                for value in values:
                    total_loss += value.float() / config.grad_accum
            trained = [p for group in optimizer.param_groups for p in group["params"]]
            if config.grad_clip is not None:
                nn.utils.clip_grad_norm_(trained, config.grad_clip)
            optimizer.step()
        if call.observe is not None:
            for parts, memory in zip(micro_batches, memories):
                observed(client, call, Step(client, parts, named, 0, step, memory))
        snapshot(step + 1)
    task_losses = {task: task_sums[task] / task_counts[task] for task in task_sums}
    state = saved_optimizer_state(optimizers, named) if call.keep_optimizer_state else None
    return TrainResult(copied(named), total_loss / max(steps, 1), task_losses, state, snapshots)


def observed(client: PlanClient, call: TrainCall, step: Step) -> None:
    """``call.observe`` (if any) on ``step``, a micro-batch whose step was taken, under the step's autocast."""
    if call.observe is not None:
        with mixed_precision(client.device, client.train_config.autocast):
            call.observe(step)


def phase_optimizer(client: PlanClient, phase: Phase, named: dict[str, torch.Tensor],
                    lr: float) -> torch.optim.Optimizer:
    """A fresh optimizer over the parameters ``phase`` trains, a group per learning rate."""
    phase_lr = phase.lr or lr
    groups: dict[float, list[torch.Tensor]] = {}
    for name, param in named.items():
        if phase.selects(name):
            own = phase.lr_of(name) if phase.lr_of is not None else None
            groups.setdefault(own or phase_lr, []).append(param)
    optimizer = build_optimizer(client.train_config,
                                [{"params": ps, "lr": group_lr} for group_lr, ps in groups.items()], phase_lr)
    for group in optimizer.param_groups:
        group["base_lr"] = group["lr"]
    return optimizer


def eager_pass(client: PlanClient, phase: Phase, index: int, micro_batches: list[list[tuple[Task, Batch]]],
               memories: list[dict], named: dict[str, torch.Tensor], step: int,
               task_sums: dict[int, torch.Tensor], task_counts: dict[int, int]) -> list[torch.Tensor]:
    """Phase ``index``'s forwards and backwards over one step's micro-batches; each micro-batch's loss
    (detached, before an extra term), the first phase's task losses added to ``task_sums``."""
    config = client.train_config
    values = []
    for parts, memory in zip(micro_batches, memories):
        step_view = Step(client, parts, named, index, step, memory)
        with mixed_precision(client.device, config.autocast):
            if phase.loss is None:
                losses = step_view.part_losses()
                value = step_view.task_loss(losses)
                if index == 0:
                    add_task_losses(task_sums, task_counts, parts, losses)
            else:
                value = phase.loss(step_view)
        values.append(value.detach())
        if phase.extra_loss is not None:
            value = value + phase.extra_loss(named)
        if config.grad_accum > 1:
            value = value / config.grad_accum
        value.backward()
    return values


def add_task_losses(sums: dict[int, torch.Tensor], counts: dict[int, int], parts: list[tuple[Task, Batch]],
                    losses: list[torch.Tensor]) -> None:
    for (task, _), loss in zip(parts, losses):
        loss = loss.detach().float()
        sums[task.index] = sums[task.index] + loss if task.index in sums else loss
        counts[task.index] = counts.get(task.index, 0) + 1
