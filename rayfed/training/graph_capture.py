"""Training steps captured once as CUDA graphs and replayed (``train.cuda_graphs``): a whole step
(:class:`GraphedStep`) or the parts of a step's micro-batches (:class:`GraphedParts`), and the captures' safety
nets. Which calls run them, and where the graphs are kept: :mod:`rayfed.training.plans`."""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from rayfed.config import TrainConfig
from rayfed.models.client import TrainableModule
from rayfed.models.peft.modules import select_task
from rayfed.tasks import Task
from rayfed.training.compiled_forward import trained_forward
from rayfed.training.lru import LeastRecentlyUsed
from rayfed.training.optimizers import build_optimizer
from rayfed.training.penalties import TensorPenalty
from rayfed.training.precision import mixed_precision
from rayfed.training.steps import CapturedLoss, Phase, Step, StepClient
from rayfed.types import Batch

log = logging.getLogger(__name__)
MAX_PARTS_PER_MODEL = 256  # the parts share one pool and their task's inputs: each a graph past them


@contextlib.contextmanager
def eager_after_a_failed_capture(device: torch.device) -> Iterator[None]:
    """Around a capture: if it fails, put back what ``torch.cuda.graph`` leaves behind, so that the eager step that
    follows, and the graphs captured before, run. A failed capture leaves its side stream current and the device's
    random generator in capture mode, where the next dropout mask drawn outside a capture, and every replay of a graph
    that draws, raises ("Offset increment outside graph capture"); a capture that succeeds ends that mode."""
    stream = torch.cuda.current_stream(device)
    try:
        yield
    except Exception:
        torch.cuda.set_stream(stream)
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.empty(1, device=device).zero_()
        raise


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """Work on ``stream``, ordered after what the device's current stream has queued, and before what it queues
    next."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream(device).wait_stream(stream)


def warm_up_and_capture(step: Callable[[], torch.Tensor], optimizers: Sequence[torch.optim.Optimizer],
                        device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``step`` run three times off the default stream (what a first step sets up: the optimizers' state, cuBLAS's
    workspace), then captured: its graph, and the tensor each replay leaves its result in."""
    side = torch.cuda.Stream(device)  # warm-up off the default stream, as graph capture requires
    with on_stream(side, device), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*capturable=True.*")  # uncaptured warm-up steps
        for _ in range(3):
            step()
    for optimizer in optimizers:
        optimizer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with eager_after_a_failed_capture(device), torch.cuda.graph(graph):
        result = step()
    return graph, result


class GraphedStep:
    """One training step (each phase's forward, loss, backward and optimizer step) of one model, trained set, task,
    batch shape and phases, captured once as a CUDA graph and replayed for every client that trains the same set.

    The steps of a foundation model with small adapters are bound by kernel launches (about a thousand
    per step); a replay launches them all at once. Each train call loads the client's values into the
    same parameter tensors and zeroes the optimizers' state in place, which is where a fresh optimizer
    starts; each batch is copied into the static inputs the graph reads, and each step's learning rate into the
    tensor the optimizers read (so a schedule, or another call's rate, replays the same graph). Each phase has its
    optimizer over the tensors it trains, as the eager step has, and ``train.grad_clip`` is captured with each. A
    phase's loss is the task loss (or a :class:`RecordedTaskLoss`) or a method's :class:`CapturedLoss`, which sees a
    :class:`Step` of the static batch and a memory its phases share. A :class:`TensorPenalty` is captured with a
    one-phase step (added to the task loss outside autocast, as the eager step adds it), reading inputs of its own
    that :meth:`load_penalty` refills for each train call.
    """

    def __init__(self, client: StepClient, named: dict[str, torch.Tensor], config: TrainConfig,
                 batch: Batch, task: Task, phases: Sequence[Phase], penalty: TensorPenalty | None = None):
        device = next(iter(batch.values())).device
        # float32: what the fused kernel computes with when given a float rate, so the steps are the eager ones
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_value = 0.0
        self.trained = [[param for name, param in named.items() if phase.selects(name)] for phase in phases]
        self.optimizers = [build_optimizer(config, trained, self.lr, capturable=True) for trained in self.trained]
        self.grad_clip = config.grad_clip
        self.autocast = config.autocast
        self.batch = {name: column.clone() for name, column in batch.items()}
        self.task = task
        self.named = named
        self.penalty = penalty
        self.penalty_inputs = {} if penalty is None else {
            slot: {name: value.to(device, copy=True) for name, value in values.items()}
            for slot, values in penalty.inputs.items()}
        # Only the capture runs the forward and the losses: a replay holds no reference to the model or the client,
        # which keep this graph.
        step = functools.partial(self._forward_backward_step, client, trained_forward(client.model, config), phases)
        start = {name: param.detach().clone() for name, param in named.items()}
        try:
            self.graph, self.loss = warm_up_and_capture(step, self.optimizers, device)
        finally:
            with torch.no_grad():  # undo the warm-up's steps
                for name, param in named.items():
                    param.copy_(start[name])

    def _forward_backward_step(self, client: StepClient, forward: Callable[[Batch], torch.Tensor],
                               phases: Sequence[Phase]) -> torch.Tensor:
        """The eager step's phases, in order (:func:`~rayfed.training.plans.eager.run_steps`); the first phase's
        loss."""
        device = next(iter(self.batch.values())).device
        memory: dict = {}
        first = None
        for index, (phase, optimizer, trained) in enumerate(zip(phases, self.optimizers, self.trained)):
            optimizer.zero_grad(set_to_none=True)
            with mixed_precision(device, self.autocast, cache_enabled=False):  # no cast cache under capture
                if isinstance(phase.loss, CapturedLoss):
                    loss = phase.loss(Step(client, [(self.task, self.batch)], self.named, index, 0, memory))
                else:
                    loss = self.task.kind.loss(forward(self.batch), self.batch)
            value = loss
            if self.penalty is not None:
                value = loss + self.penalty.term(self.named, self.penalty_inputs, *self.penalty.settings)
            value.backward()
            if self.grad_clip is not None:
                nn.utils.clip_grad_norm_(trained, self.grad_clip)
            optimizer.step()
            first = loss.detach().float() if first is None else first
        return first

    def load_penalty(self, penalty: TensorPenalty | None) -> None:
        """Copy this train call's penalty inputs into the ones the graph reads."""
        for slot, values in self.penalty_inputs.items():
            for name, value in values.items():
                value.copy_(penalty.inputs[slot][name], non_blocking=True)

    def reset_optimizers(self) -> None:
        # A fresh SGD's first step sets its momentum buffer to the gradient; the captured later step computes
        # momentum * buffer + gradient, which from a zeroed buffer is that gradient exactly (torch's dampening 0).
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    value.zero_()

    def step(self, batch: Batch, lr: float) -> torch.Tensor:
        """One step on ``batch`` at learning rate ``lr``; returns its loss (a tensor on the GPU, valid until the next
        step)."""
        for name, column in batch.items():
            self.batch[name].copy_(column, non_blocking=True)
        if lr != self.lr_value:  # a fill on the device, queued: no wait for the host
            self.lr.fill_(lr)
            self.lr_value = lr
        self.graph.replay()
        return self.loss


class GraphedParts:
    """The forward, loss and backward of each part of a step's micro-batches (one task's rows of a client holding
    several tasks, or one of ``train.grad_accum`` micro-batches), captured as a CUDA graph per (task, rows, the
    model's :meth:`~rayfed.models.TrainableModule.host_choices`) and replayed; the optimizer step, the clip and the
    schedule run eagerly, as without graphs.

    A part's graph adds the gradient of its loss, times its share of the micro-batch's rows (and over
    ``train.grad_accum``), into gradient tensors every part shares: the eager step's gradient of the weighted sum,
    part by part, with the same dropout draws in the same order (a backward draws none). :meth:`hand_gradients`
    gives a parameter the step's gradient only where a part of the step reaches it, so that the optimizer skips the
    others as it does eagerly. The graphs share one memory pool: they never run at once, each leaves what it computes
    in tensors made outside the pool (its loss, the gradients), and a task's first capture runs a warm-up first,
    outside the pool, so that what a forward caches (a per-device constant) is made there. The parts of one task read
    their rows from the first rows of the same inputs (:meth:`static_rows`). Each capture goes through
    :func:`capturing`, without the device-wide synchronize of ``torch.cuda.graph``: a client's first rounds capture
    dozens of parts. A task whose part cannot be captured (its forward reads a value back to the host that its model
    does not declare a choice) trains eagerly from then on."""

    def __init__(self, named: dict[str, torch.Tensor]):
        self.named = named
        device = next(iter(named.values())).device
        self.buffers: list[torch.Tensor] = []  # one per dtype: a step zeroes each in one kernel
        self.gradients: dict[str, torch.Tensor] = {}
        for dtype in dict.fromkeys(param.dtype for param in named.values()):
            members = [(name, param) for name, param in named.items() if param.dtype == dtype]
            buffer = torch.zeros(sum(param.numel() for _, param in members), dtype=dtype, device=device)
            self.buffers.append(buffer)
            for (name, param), flat in zip(members, buffer.split([param.numel() for _, param in members])):
                self.gradients[name] = flat.view_as(param)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # every warm-up and capture: what a stream sets up once is kept
        self.parts: LeastRecentlyUsed[tuple, _GraphedPart] = LeastRecentlyUsed(MAX_PARTS_PER_MODEL)
        self.uncapturable: set[int] = set()  # tasks whose forward could not be captured (it reads a value back)
        self.reached: set[str] = set()  # the parameters this step's parts reached so far
        # by task, whatever the rows: the parameters its path reaches and its loss's dtype (from a first warm-up)
        self.warmed: dict[int, tuple[frozenset[str], torch.dtype]] = {}
        self.inputs: dict[tuple, Batch] = {}  # by (task, micro-batch rows, columns): what its parts' rows are views of

    def static_rows(self, task: Task, batch: Batch, total: int) -> Batch:
        """``batch`` copied into the first rows of the inputs every part of its task and columns reads (a graph per
        row count, one copy of the inputs)."""
        specs = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in batch.items())
        key = (task.index, total, specs)
        if key not in self.inputs:
            self.inputs[key] = {name: column.new_empty((total, *column.shape[1:])) for name, column in batch.items()}
        rows = len(next(iter(batch.values())))
        views = {name: column[:rows] for name, column in self.inputs[key].items()}
        for name, column in batch.items():
            views[name].copy_(column)
        return views

    @staticmethod
    def key(model: TrainableModule, task: Task, batch: Batch, total: int) -> tuple:
        """A part's graph: its task, rows, the micro-batch's rows, its columns' shapes and its model's host choices."""
        rows = len(next(iter(batch.values())))
        columns = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in batch.items())
        return task.index, rows, total, columns, model.host_choices(task.index, batch)

    def capture(self, model: TrainableModule, config: TrainConfig, used: Sequence[tuple],
                wanted: dict[tuple, tuple[Task, Batch, int]]) -> bool:
        """Capture the parts of ``wanted`` (by key: a part's task, a batch of its rows, the micro-batch's rows), the
        least recently used of those not in ``used`` (the call's keys) dropped past :data:`MAX_PARTS_PER_MODEL`;
        whether every part of the call can run (False: one could not be captured, and the call trains eagerly)."""
        if any(task.index in self.uncapturable for task, _, _ in wanted.values()):
            return False
        for key in dict.fromkeys(used):
            self.parts.use(key)
        for key, (task, batch, total) in wanted.items():
            forward = functools.partial(_task_forward, model, config, task.index, key[-1])
            try:
                self.parts.get_or_make(key, lambda: _GraphedPart(forward, task, batch, total, config, self), keep=used)
            except RuntimeError as err:  # e.g. a forward that reads a value back to the host mid-step
                log.warning("train.cuda_graphs: the training step of task %s of this %s could not be captured as a "
                            "CUDA graph (%s); its clients train eagerly.", task.name, type(model).__name__,
                            str(err).splitlines()[0])
                self.uncapturable.add(task.index)
                self.pool = torch.cuda.graph_pool_handle()  # the failed capture left the pool's allocation open
                return False
        return True

    def start_step(self) -> None:
        for buffer in self.buffers:
            buffer.zero_()
        self.reached = set()

    def add_gradients(self, parts: Sequence[tuple[Task, Batch]], keys: Sequence[tuple]) -> list[torch.Tensor]:
        """Replay each part of one micro-batch (its key in ``keys``) on its rows, adding its gradient; the parts'
        losses."""
        losses = []
        for (_, batch), key in zip(parts, keys):
            part = self.parts[key]
            self.reached |= part.reached
            losses.append(part.run(batch))
        return losses

    def hand_gradients(self) -> None:
        """Give the trained parameters the gradients of the step: those no part of it reached none."""
        for name, param in self.named.items():
            param.grad = self.gradients[name] if name in self.reached else None


def _task_forward(model: TrainableModule, config: TrainConfig, task_index: int, choices: object,
                  batch: Batch) -> torch.Tensor:
    """The training forward of task ``task_index`` with the model's host ``choices`` taken as made: what a part's
    graph captures, its task selected inside it (Python alone, no kernel)."""
    select_task(model, task_index)
    with model.making_choices(choices):
        return trained_forward(model, config)(batch)


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: tuple, stream: torch.cuda.Stream) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool, stream)`` without what it does first: synchronize the device and empty the
    allocator's cache (and the host's pinned one). A client's first rounds capture dozens of small parts, each of which
    would otherwise stall the device and make every allocation after it a fresh ``cudaMalloc``."""
    device_stream = torch.cuda.current_stream(stream.device)
    stream.wait_stream(device_stream)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool)
        try:
            yield
        finally:
            graph.capture_end()
    device_stream.wait_stream(stream)


def captured_part(body: Callable[[], None], pool: tuple, stream: torch.cuda.Stream,
                  device: torch.device) -> torch.cuda.CUDAGraph:
    """``body`` captured as a CUDA graph in ``pool`` on ``stream`` (:func:`capturing`); a failed capture cleaned up
    (:func:`eager_after_a_failed_capture`) and raised."""
    graph = torch.cuda.CUDAGraph()
    with eager_after_a_failed_capture(device), capturing(graph, pool, stream):
        body()
    return graph


class _GraphedPart:
    """One part's graph (see :class:`GraphedParts`): the rows it reads, the loss it leaves, the parameters it
    reaches."""

    def __init__(self, forward: Callable[[Batch], torch.Tensor], task: Task, batch: Batch, total: int,
                 config: TrainConfig, owner: GraphedParts):
        device = next(iter(batch.values())).device
        self.batch = owner.static_rows(task, batch, total)
        share = len(next(iter(batch.values()))) / total
        names, params = list(owner.named), list(owner.named.values())

        def gradients(wrt: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
            with mixed_precision(device, config.autocast, cache_enabled=False):  # no cast cache under capture
                loss = task.kind.loss(forward(self.batch), self.batch)
                value = loss if share == 1 else loss * share  # Step.task_loss's terms
            if config.grad_accum > 1:
                value = value / config.grad_accum
            return loss.detach(), torch.autograd.grad(value, wrt, allow_unused=True)

        if task.index not in owner.warmed:
            # A task's first part: one warm-up on the capture's stream (off the default one, as capture requires)
            # finds the parameters its path reaches and makes, outside the pool, what a first forward or backward
            # sets up (a per-device constant, the stream's cuBLAS workspace); its later parts reuse both.
            with on_stream(owner.stream, device):
                loss, grads = gradients(params)
            owner.warmed[task.index] = frozenset(n for n, grad in zip(names, grads) if grad is not None), loss.dtype
        self.reached, loss_dtype = owner.warmed[task.index]
        wrt = [param for name, param in zip(names, params) if name in self.reached]
        targets = [owner.gradients[name] for name in names if name in self.reached]
        self.loss = torch.zeros((), dtype=loss_dtype, device=device)  # outside the pool, as the gradients are

        def accumulate() -> None:
            loss, grads = gradients(wrt)
            for target, grad in zip(targets, grads):
                target.add_(grad)
            self.loss.copy_(loss)

        self.graph = captured_part(accumulate, owner.pool, owner.stream, device)

    def run(self, batch: Batch) -> torch.Tensor:
        """The part on ``batch``'s rows; its loss (a copy: the next replay overwrites the graph's)."""
        for name, column in batch.items():
            self.batch[name].copy_(column, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()
