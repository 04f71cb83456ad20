"""What makes a training step fast on a GPU: bf16 autocast, ``torch.compile`` of the model (``train.compile``) and
a step captured once as a CUDA graph and replayed (``train.cuda_graphs``)."""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from rayfed.config import TrainConfig
from rayfed.data.batches import ClientData, TaskData
from rayfed.errors import ConfigError
from rayfed.models.client import TrainableModule
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
    """Refuse ``train.autocast: off`` for a model on a GPU that stores weights in bfloat16 (a ``llama:`` backbone):
    its steps would not be float32, and without autocast its float32 adapters cannot run over them."""
    if (config.autocast == "off" and device.type == "cuda"
            and any(param.dtype == torch.bfloat16 for param in model.parameters())):
        raise ConfigError(f"train.autocast = 'off' computes in float32, but the model of {where} stores weights in "
                          "bfloat16 on a GPU (a llama: backbone), so train.autocast must be 'bf16' for it there.")


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
            with torch.cuda.graph(self.graph):
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
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphedStep | None]] = weakref.WeakKeyDictionary()


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
