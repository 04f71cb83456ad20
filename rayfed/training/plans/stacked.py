"""The stacked plan (``train.batch_clients``): several clients of one actor trained in one forward and backward over
their stacked parameters.

An actor runs its round's local updates as threads that take turns in client-id order (:class:`Lockstep`): each
runs its method's hook until the hook asks :meth:`ClientContext.train <rayfed.training.ClientContext.train>` for a
plain update (the task loss, optionally plus a penalty; one phase, one task, no kept optimizer state), which
:class:`StackedPlan` hands to the lockstep, or returns.
When every unfinished hook waits, the waiting updates that train the same parameters the same way run together
(:func:`train_together`): ``torch.func.vmap`` over the clients' stacked values and batches, so every matrix
product of the frozen backbone runs once over all of their rows and each client's LoRA products become batched
ones. Each client's loss depends on its own values only, so the gradient of their sum is, client by client, each
one's own gradient; with per-client clipping and an elementwise optimizer, each client's step is its sequential
one, up to the order of floating-point sums. Everything else a hook does runs alone, in turn, as without
batching; a group of one trains exactly as without batching. The numbers: ``benchmarks/README.md``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from rayfed import seeding
from rayfed.config import TrainConfig
from rayfed.models.client import TrainableModule
from rayfed.models.peft.modules import select_task
from rayfed.tasks import Task
from rayfed.training.optimizers import build_optimizer, scheduled_lr
from rayfed.training.plans.call import PlanClient, StepPlan, TrainCall, TrainResult
from rayfed.training.precision import mixed_precision

log = logging.getLogger(__name__)
R = TypeVar("R")
# Under vmap the memory-efficient attention kernel's backward gets a misaligned log-sum-exp on CUDA ("LSE is not
# correctly aligned (strideH)", torch 2.11); the other kernels batch.
ATTENTION_UNDER_VMAP = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


class StackedClient(PlanClient, Protocol):
    """What the stacked plan reads of its client (:class:`rayfed.training.ClientContext`): the lockstep it waits in."""

    lockstep: Lockstep | None


class StackedPlan:
    """Hands a plain update to its client's lockstep (:class:`Lockstep`), which trains it stacked with the other
    clients' that wait with it. Keeps whether the model's steps run under vmap, and with ``train.compile`` their
    compiled versions by task. A group of one trains by the plan ``alone`` picks for it."""

    def __init__(self, alone: Callable[[StackedClient, TrainCall], StepPlan]):
        self.alone = alone
        self.stackable = True
        self.compiled: dict[int, Callable] = {}

    def run(self, client: StackedClient, call: TrainCall) -> TrainResult:
        assert client.lockstep is not None
        return client.lockstep.train(TrainRequest(client, call, self))

    def mark_unstackable(self, model: TrainableModule, error: BaseException | None) -> None:
        """This model's clients train one at a time from now on. E.g. Hugging Face's attention masks read a
        tensor's value to pick a path (torch.compile's tracing avoids that), and on a GPU some bf16 kernels' batching
        rules fail in the backward."""
        self.stackable = False
        log.warning("train.batch_clients: a step of this %s cannot run under torch.func.vmap (%s); its clients train "
                    "one at a time.", type(model).__name__, str(error).splitlines()[0][:160])


@dataclass
class TrainRequest:
    """One client's plain update, as :meth:`ClientContext.train` was asked for it, and the plan it waits in."""

    client: StackedClient
    call: TrainCall
    plan: StackedPlan
    result: TrainResult | None = None
    error: BaseException | None = None

    def key(self) -> tuple:
        """Updates with equal keys can train together: the same trained tensors, task, batch shape and budget."""
        client = self.client
        part = client.data.parts[0]
        call = self.call
        rows = client.data.num_train if call.pool is None else len(call.pool)
        columns = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in part.train.items())
        tensors = tuple((name, tuple(value.shape), value.dtype) for name, value in call.params.items())
        return (tensors, part.task, columns, min(client.train_config.batch_size, rows), call.steps, call.purpose,
                call.lr, id(client.model))


class Lockstep(Generic[R]):
    """Runs callables as threads taking turns in list order, each until it returns or waits in :meth:`train`;
    when all unfinished ones wait, their requests train together and the turns start again from the first."""

    def __init__(self, max_clients: int):
        self.max_clients = max_clients
        self._cond = threading.Condition()
        self._local = threading.local()
        self._turn: int | None = None
        self._count = 0
        self._waiting: dict[int, TrainRequest] = {}
        self._finished: set[int] = set()

    def run(self, updates: Sequence[Callable[[], R]]) -> list[R]:
        """Each update's return value, in order; the first update's exception (in list order) is raised."""
        self._count, self._turn, self._waiting, self._finished = len(updates), 0, {}, set()
        results: list = [None] * len(updates)
        errors: list[BaseException | None] = [None] * len(updates)

        def body(index: int) -> None:
            self._local.index = index
            with self._cond:
                self._cond.wait_for(lambda: self._turn == index)
            try:
                results[index] = updates[index]()
            except BaseException as error:  # noqa: BLE001 - re-raised below, in the caller's thread
                errors[index] = error
            finally:
                with self._cond:
                    self._finished.add(index)
                    self._pass_turn(index)

        threads = [threading.Thread(target=body, args=(index,), daemon=True) for index in range(len(updates))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for error in errors:
            if error is not None:
                raise error
        return results

    def train(self, request: TrainRequest) -> TrainResult:
        """A plain update (see :meth:`ClientContext.train`), trained with the other updates' ones."""
        index = self._local.index
        with self._cond:
            self._waiting[index] = request
            self._pass_turn(index)
            self._cond.wait_for(lambda: self._turn == index)
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _pass_turn(self, index: int) -> None:
        """(Lock held.) The turn goes to the next unfinished update; after the last, the waiting requests train
        and the turn goes back to the first unfinished one."""
        following = [j for j in range(index + 1, self._count) if j not in self._finished]
        if not following:
            if self._waiting:
                waiting = [self._waiting[j] for j in sorted(self._waiting)]
                self._waiting = {}
                try:
                    train_together(waiting, self.max_clients)
                except Exception as error:  # noqa: BLE001 - e.g. grouping failed: every waiting hook raises it
                    for request in waiting:
                        if request.result is None:
                            request.error = error
            following = [j for j in range(self._count) if j not in self._finished]
        self._turn = following[0] if following else None
        self._cond.notify_all()


def train_together(requests: Sequence[TrainRequest], max_clients: int) -> None:
    """Fill in every request's result (or error): requests with equal keys in groups of up to ``max_clients``,
    in the order given, a group of one by the client's own sequential update."""
    groups: dict[tuple, list[TrainRequest]] = {}
    for request in requests:
        groups.setdefault(request.key(), []).append(request)
    for members in groups.values():
        for start in range(0, len(members), max_clients):
            chunk = members[start:start + max_clients]
            plan = chunk[0].plan
            try:
                if len(chunk) > 1 and plan.stackable:
                    try:
                        results = _train_stacked(chunk)
                    except CannotStack as error:
                        plan.mark_unstackable(chunk[0].client.model, error.__cause__)
                if len(chunk) == 1 or not plan.stackable:
                    results = [plan.alone(request.client, request.call).run(request.client, request.call)
                               for request in chunk]
                for request, result in zip(chunk, results):
                    request.result = result
            except Exception as error:  # noqa: BLE001 - each client's thread raises it
                for request in chunk:
                    request.error = error


class CannotStack(Exception):
    """The first stacked step failed (before any update): the model's forward or backward cannot run under vmap."""


def _train_stacked(requests: Sequence[TrainRequest]) -> list[TrainResult]:
    first = requests[0].client
    model, config, device = first.model, first.train_config, first.device
    task = first.tasks[first.task]
    select_task(model, task.index)
    model.train()
    live = dict(model.named_parameters())
    stacked = {name: torch.stack([r.call.params[name].to(device=device, dtype=live[name].dtype) for r in requests])
               .requires_grad_(True) for name in requests[0].call.params}
    optimizer = build_optimizer(config, list(stacked.values()), requests[0].call.lr)
    for group in optimizer.param_groups:
        group["base_lr"] = group["lr"]
    batch_orders = [r.client.batch_order(r.call.steps, r.call.purpose, r.call.pool) for r in requests]
    # The first client's dropout stream; vmap draws each client's masks from it, different ones per client.
    purpose = requests[0].call.purpose
    torch.manual_seed(seeding.torch_seed(first.seed, first.round, first.client_id, purpose + ":dropout"))
    part = first.data.parts[0]
    step_fn = _stacked_step(requests[0].plan, model, task, config)
    losses = torch.zeros(len(requests), device=device)
    for step in range(requests[0].call.steps):
        if config.schedule != "constant" and requests[0].call.purpose == "train":
            global_step = first.round * requests[0].call.steps + step
            for group in optimizer.param_groups:
                group["lr"] = scheduled_lr(config, group["base_lr"], first.round, global_step)
        rows = [next(order) for order in batch_orders]
        batch = {name: torch.stack([r.client.data.parts[0].train[name][index] for r, index in zip(requests, rows)])
                 .to(device, non_blocking=True) for name in part.train}
        for value in stacked.values():
            value.grad = None
        try:
            with mixed_precision(device, config.autocast), sdpa_kernel(ATTENTION_UNDER_VMAP):
                step_losses = step_fn(stacked, batch)
            # Client i's values reach only its own loss: the sum's gradient is, row by row, each client's own.
            total = step_losses.sum()
            for i, request in enumerate(requests):
                extra_loss = request.call.phases[0].extra_loss
                if extra_loss is not None:
                    total = total + extra_loss({name: value[i] for name, value in stacked.items()})
            total.backward()
        except RuntimeError as error:
            if step > 0:
                raise
            raise CannotStack() from error
        if config.grad_clip is not None:
            _clip_per_client(list(stacked.values()), config.grad_clip)
        optimizer.step()
        losses += step_losses.detach().float()
    steps = max(requests[0].call.steps, 1)
    results = []
    for i, request in enumerate(requests):
        loss = losses[i] / steps
        results.append(TrainResult({name: value[i].detach().clone() for name, value in stacked.items()}, loss,
                                   {task.index: loss}))
    return results


def _stacked_step(plan: StackedPlan, model: TrainableModule, task: Task, config: TrainConfig) -> Callable:
    """Each client's task loss, given the clients' stacked values and batches: vmap over clients (with
    ``train.compile``: its torch.compile, built once per model and task and kept by ``plan``)."""

    def client_loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return task.kind.loss(functional_call(model, params, (batch,), strict=False), batch)

    step = vmap(client_loss, randomness="different")
    if not config.compile:
        return step
    compiled = plan.compiled
    if task.index not in compiled:
        compiled[task.index] = torch.compile(step)
    return compiled[task.index]


def _clip_per_client(stacked: list[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_`` of each client's own gradient (one row of every stacked tensor)."""
    grads = [value.grad for value in stacked]
    norms = torch.stack([g.detach().flatten(1).float().norm(dim=1) for g in grads]).norm(dim=0)
    scale = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *([1] * (g.dim() - 1))).to(g.dtype))
