"""What makes a training step fast on a GPU: bf16 autocast, ``torch.compile`` of the model (``train.compile``) and
a step captured once as a CUDA graph and replayed (``train.cuda_graphs``)."""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from rayfed.config import TrainConfig
from rayfed.data.batches import ClientData, TaskData
from rayfed.errors import ConfigError
from rayfed.models.client import TrainableModule
from rayfed.models.peft.modules import select_task
from rayfed.training.optimizers import build_optimizer
from rayfed.tasks import Task
from rayfed.types import Batch, TensorDict

log = logging.getLogger(__name__)


def mixed_precision(device: torch.device, autocast: str, cache_enabled: bool = True) -> torch.autocast:
    """What a step or evaluation on ``device`` computes in: with ``train.autocast`` ``autocast`` = ``bf16``, bf16
    autocast on a GPU; with ``off``, and on the CPU, nothing (float32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and autocast == "bf16",
                          cache_enabled=cache_enabled)


def check_precision(model: nn.Module, config: TrainConfig, device: torch.device, where: str) -> None:
    """Refuse ``train.autocast: off`` for a model on a GPU that stores weights in half precision (a ``llama:`` or
    ``llava:`` backbone, a hub checkpoint shipped in bf16 or fp16): its steps would not be float32, and without
    autocast its float32 adapters cannot run over them."""
    half = next((p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)), None)
    if config.autocast == "off" and device.type == "cuda" and half is not None:
        raise ConfigError(f"train.autocast = 'off' computes in float32, but the model of {where} stores weights in "
                          f"{str(half).removeprefix('torch.')} on a GPU (a llama: or llava: backbone, or a hub "
                          "checkpoint shipped so), so train.autocast must be 'bf16' for it there.")


PenaltyTerm = Callable[..., torch.Tensor]


class TensorPenalty:
    """An extra loss term a method declares safe to capture in a CUDA graph with its step (``train.cuda_graphs``):
    ``term(params, inputs, *settings)``, pure tensor work on the live trained tensors (``params``, by name) and the
    tensors ``inputs`` (slots of named tensors: the received global model, ...), its Python numbers in ``settings``.

    ``term`` must not read a value back to the host, branch on one, or keep state between calls; it is a function of
    its arguments alone (a closure, which could hold other tensors, is refused). A captured step reads copies of
    ``inputs`` that each train call refills, and serves only penalties with the same ``term``, ``settings`` and input
    shapes. Any other penalty (a plain function of the parameters) runs the step eagerly, which is the safe default.
    """

    def __init__(self, term: PenaltyTerm, inputs: dict[str, TensorDict], settings: tuple[float, ...] = ()):
        if getattr(term, "__closure__", None):
            raise TypeError(f"TensorPenalty's term {term.__qualname__} closes over variables of its surroundings; "
                            "pass the tensors it reads as inputs and its numbers as settings.")
        self.term, self.inputs, self.settings = term, inputs, tuple(settings)
        self._on_device: dict[torch.device, dict[str, TensorDict]] = {}

    def __call__(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(iter(params.values())).device
        if device not in self._on_device:  # inputs arrive on the CPU; moved once, not every step
            self._on_device[device] = {slot: {name: value.to(device) for name, value in values.items()}
                                       for slot, values in self.inputs.items()}
        return self.term(params, self._on_device[device], *self.settings)

    def key(self) -> tuple:
        """What a captured step bakes in: the term, its settings and its inputs' names, shapes and dtypes."""
        specs = tuple((slot, tuple((name, tuple(value.shape), value.dtype) for name, value in values.items()))
                      for slot, values in self.inputs.items())
        return self.term, self.settings, specs


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


class GraphedStep:
    """One training step (forward, loss, backward, optimizer step) of one model, trained set, task and batch
    shape, captured once as a CUDA graph and replayed for every client that trains the same set.

    The steps of a foundation model with small adapters are bound by kernel launches (about a thousand
    per step); a replay launches them all at once. Each train call loads the client's values into the
    same parameter tensors and zeroes the optimizer's state in place, which is where a fresh optimizer
    starts; each batch is copied into the static inputs the graph reads, and each step's learning rate into the
    tensor the optimizer reads (so a schedule, or another call's rate, replays the same graph). ``train.grad_clip``
    is captured with the step. A :class:`TensorPenalty` is captured with it too (added to the task loss outside
    autocast, as the eager step adds it), reading inputs of its own that :meth:`load_penalty` refills for each
    train call.
    """

    def __init__(self, model: TrainableModule, named: dict[str, torch.Tensor], config: TrainConfig,
                 batch: Batch, task: Task, penalty: TensorPenalty | None = None):
        device = next(iter(batch.values())).device
        # float32: what the fused kernel computes with when given a float rate, so the steps are the eager ones
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_value = 0.0
        self.optimizer = build_optimizer(config, list(named.values()), self.lr, capturable=True)
        self.grad_clip = config.grad_clip
        # Only the capture runs the forward: a replay holds no reference to the model, which keys _GRAPHS weakly.
        forward = trained_forward(model, config)
        self.autocast = config.autocast
        self.batch = {name: column.clone() for name, column in batch.items()}
        self.task = task
        self.named = named
        self.penalty = penalty
        self.penalty_inputs = {} if penalty is None else {
            slot: {name: value.to(device, copy=True) for name, value in values.items()}
            for slot, values in penalty.inputs.items()}
        start = {name: param.detach().clone() for name, param in named.items()}
        try:
            side = torch.cuda.Stream(device)  # warm-up off the default stream, as graph capture requires
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*capturable=True.*")  # uncaptured warm-up steps
                for _ in range(3):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._forward_backward_step(forward)
            torch.cuda.current_stream(device).wait_stream(side)
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with eager_after_a_failed_capture(device), torch.cuda.graph(self.graph):
                self.loss = self._forward_backward_step(forward)
        finally:
            with torch.no_grad():  # undo the warm-up's steps
                for name, param in named.items():
                    param.copy_(start[name])

    def _forward_backward_step(self, forward: Callable[[Batch], torch.Tensor]) -> torch.Tensor:
        device = next(iter(self.batch.values())).device
        with mixed_precision(device, self.autocast, cache_enabled=False):  # no cast cache under capture
            loss = self.task.kind.loss(forward(self.batch), self.batch)
        value = loss
        if self.penalty is not None:
            value = loss + self.penalty.term(self.named, self.penalty_inputs, *self.penalty.settings)
        value.backward()
        if self.grad_clip is not None:
            nn.utils.clip_grad_norm_(list(self.named.values()), self.grad_clip)
        self.optimizer.step()
        return loss.detach().float()

    def load_penalty(self, penalty: TensorPenalty | None) -> None:
        """Copy this train call's penalty inputs into the ones the graph reads."""
        for slot, values in self.penalty_inputs.items():
            for name, value in values.items():
                value.copy_(penalty.inputs[slot][name], non_blocking=True)

    def reset_optimizer(self) -> None:
        # A fresh SGD's first step sets its momentum buffer to the gradient; the captured later step computes
        # momentum * buffer + gradient, which from a zeroed buffer is that gradient exactly (torch's dampening 0).
        for state in self.optimizer.state.values():
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
        self.parts: dict[tuple, _GraphedPart] = {}
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
        return (task.index, rows, total, tuple((name, tuple(column.shape[1:]), column.dtype)
                                                for name, column in batch.items()), model.host_choices(task.index, batch))

    def capture(self, model: TrainableModule, config: TrainConfig, used: Sequence[tuple],
                wanted: dict[tuple, tuple[Task, Batch, int]]) -> bool:
        """Capture the parts of ``wanted`` (by key: a part's task, a batch of its rows, the micro-batch's rows), the
        least recently used of those not in ``used`` (the call's keys) dropped past :data:`MAX_PARTS_PER_MODEL`;
        whether every part of the call can run (False: one could not be captured, and the call trains eagerly)."""
        if any(task.index in self.uncapturable for task, _, _ in wanted.values()):
            return False
        for key in dict.fromkeys(used):
            if key in self.parts:
                self.parts[key] = self.parts.pop(key)  # most recently used last
        for key, (task, batch, total) in wanted.items():
            while len(self.parts) >= MAX_PARTS_PER_MODEL and next(iter(self.parts)) not in used:
                del self.parts[next(iter(self.parts))]
            try:
                select_task(model, task.index)
                with model.making_choices(key[-1]):
                    self.parts[key] = _GraphedPart(trained_forward(model, config), task, batch, total, config, self)
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


class _GraphedPart:
    """One part's graph (see :class:`GraphedParts`): the rows it reads, the loss it leaves, the parameters it reaches."""

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
            owner.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(owner.stream):
                loss, grads = gradients(params)
            torch.cuda.current_stream(device).wait_stream(owner.stream)
            owner.warmed[task.index] = frozenset(n for n, grad in zip(names, grads) if grad is not None), loss.dtype
        self.reached, loss_dtype = owner.warmed[task.index]
        wrt = [param for name, param in zip(names, params) if name in self.reached]
        targets = [owner.gradients[name] for name in names if name in self.reached]
        self.loss = torch.zeros((), dtype=loss_dtype, device=device)  # outside the pool, as the gradients are
        self.graph = torch.cuda.CUDAGraph()
        with eager_after_a_failed_capture(device), capturing(self.graph, owner.pool, owner.stream):
            loss, grads = gradients(wrt)
            for target, grad in zip(targets, grads):
                target.add_(grad)
            self.loss.copy_(loss)

    def run(self, batch: Batch) -> torch.Tensor:
        """The part on ``batch``'s rows; its loss (a copy: the next replay overwrites the graph's)."""
        for name, column in batch.items():
            self.batch[name].copy_(column, non_blocking=True)
        self.graph.replay()
        return self.loss.clone()


class CompiledForward:
    """A model's ``torch.compile``, kept in its attachments (a submodule of its model it must not become).

    Where the model's code stops tracing (a value read back to the host, Python the compiler cannot follow), the
    compiled forward runs in pieces with that code eagerly between them, which the first call reports in one
    warning. Where compiling fails, it warns once and runs the model eagerly from then on; the step that failed
    restarts eagerly (its dropout draws are then not the eager run's)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.compiled = torch.compile(model)
        self.eager = False
        self.called = False

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.eager:
            return self.model(*args, **kwargs)
        breaks = set(counters["graph_break"])
        try:
            outputs = self.compiled(*args, **kwargs)
        except TorchDynamoException as err:
            self.eager = True
            log.warning("train.compile: the forward of this %s could not be compiled (%s: %s); it trains eagerly.",
                        type(self.model).__name__, type(err).__name__, _first_line(err))
            return self.model(*args, **kwargs)
        if not self.called:
            self.called = True
            new = [reason for reason in counters["graph_break"] if reason not in breaks]
            if new:
                log.warning("train.compile: the forward of this %s compiles in pieces, with the code at %d place(s) "
                            "running eagerly between them (%s).", type(self.model).__name__, len(new),
                            "; ".join(_first_line(reason) for reason in new[:3]))
        return outputs


def _first_line(text: object) -> str:
    return (str(text).strip().splitlines() or [""])[0][:200]


def trained_forward(model: TrainableModule, config: TrainConfig) -> nn.Module | CompiledForward:
    """What a training step calls: ``model``, or with ``train.compile`` its :class:`CompiledForward`, built once per
    model.

    Clients' values are loaded into the same parameter tensors, which the compiled code reads as inputs, so one
    compilation (per task and batch shape) serves every client of the model. Before compiling, the model's patch
    embeddings become matrix products (:class:`PatchMatmul`)."""
    if not config.compile:
        return model
    compiled = model.attachments.get(CompiledForward)
    if compiled is None:
        for module in model.modules():
            if PatchMatmul.replaces(module):
                # In place, so that parameters, hooks and every reference to the module stay as they are.
                module.__class__ = PatchMatmul
        compiled = model.attachments.put(CompiledForward(model))
    return compiled


class PatchMatmul(nn.Conv2d):
    """A convolution whose stride equals its kernel (a ViT's patch embedding), computed as one matrix product of
    the non-overlapping patches with the flattened kernel: the same products and sums. cuDNN runs ViT-B/16's
    at a sixth of the speed of the matrix product (0.59 ms against 0.09 ms at batch 64 on an H200), which was 3%
    of a compiled LoRA step."""

    @staticmethod
    def replaces(module: nn.Module) -> bool:
        """Whether ``module`` is a plain convolution over non-overlapping patches."""
        return (type(module) is nn.Conv2d and module.stride == module.kernel_size and module.dilation == (1, 1)
                and module.groups == 1 and module.padding in ((0, 0), "valid"))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4:
            return super().forward(images)
        batch, channels = images.shape[:2]
        kernel_h, kernel_w = self.kernel_size
        rows, cols = images.shape[2] // kernel_h, images.shape[3] // kernel_w
        # A convolution drops the pixels past the last whole patch.
        patches = (images[:, :, : rows * kernel_h, : cols * kernel_w]
                   .reshape(batch, channels, rows, kernel_h, cols, kernel_w)
                   .permute(0, 2, 4, 1, 3, 5)
                   .reshape(batch * rows * cols, channels * kernel_h * kernel_w))
        out = nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.reshape(batch, rows, cols, self.out_channels).permute(0, 3, 1, 2)


MAX_GRAPHS_PER_MODEL = 4  # each graph keeps a step's activations in a memory pool of its own
MAX_PARTS_PER_MODEL = 256  # the parts share one pool and their task's inputs: each a graph past them
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphedStep | None]] = weakref.WeakKeyDictionary()
_PARTS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphedParts]] = weakref.WeakKeyDictionary()


def graphed_step(model: TrainableModule, named: dict[str, torch.Tensor], config: TrainConfig,
                  data: ClientData, task: Task, penalty: TensorPenalty | None = None) -> GraphedStep | None:
    """The model's graph for this trained set, task (the forward path: heads, label space), batch shape,
    optimizer, gradient clipping and penalty (captured on first use, the least recently used of
    :data:`MAX_GRAPHS_PER_MODEL` dropped), its optimizer state zeroed and the penalty's inputs loaded; None when the
    step cannot be captured (it then runs eagerly). The learning rate is not part of it: each step sets it."""
    part: TaskData = data.parts[0]
    batch_size = min(config.batch_size, data.num_train)
    shapes = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in part.train.items())
    key = (tuple(named), task.index, batch_size, shapes, config.optimizer, config.weight_decay, config.grad_clip,
           config.autocast, None if penalty is None else penalty.key())
    graphs = _GRAPHS.setdefault(model, {})
    if key in graphs:
        graphs[key] = graphs.pop(key)  # most recently used last
    else:
        if len(graphs) == MAX_GRAPHS_PER_MODEL:
            del graphs[next(iter(graphs))]
        device = next(iter(named.values())).device
        try:
            batch = {name: column[:batch_size].to(device) for name, column in part.train.items()}
            graphs[key] = GraphedStep(model, named, config, batch, task, penalty)
        except RuntimeError as err:  # e.g. a forward that reads a value back to the host mid-step
            log.warning("train.cuda_graphs: the training step of this %s could not be captured as a CUDA graph "
                        "(%s); it trains eagerly.", type(model).__name__, str(err).splitlines()[0])
            graphs[key] = None
    if graphs[key] is not None:
        graphs[key].reset_optimizer()
        graphs[key].load_penalty(penalty)
    return graphs[key]


def graphed_parts(model: TrainableModule, named: dict[str, torch.Tensor], config: TrainConfig) -> GraphedParts:
    """The model's captured parts for this trained set (:class:`GraphedParts`), made on first use."""
    # What every part's graph bakes in besides its own key: the trained set, precision, compilation, accumulation.
    key = (tuple((name, tuple(param.shape), param.dtype) for name, param in named.items()), config.autocast,
           config.compile, config.grad_accum)
    families = _PARTS.setdefault(model, {})
    if key in families:
        families[key] = families.pop(key)
    else:
        if len(families) == MAX_GRAPHS_PER_MODEL:
            del families[next(iter(families))]
        families[key] = GraphedParts(named)
    return families[key]
