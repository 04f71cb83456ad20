"""What makes a training step fast on a GPU: bf16 autocast, ``torch.compile`` of the model (``train.compile``) and
a step captured once as a CUDA graph and replayed (``train.cuda_graphs``)."""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from rayfed.config import TrainConfig
from rayfed.data.batches import ClientData, TaskData
from rayfed.models.client import TrainableModule
from rayfed.training.optimizers import build_optimizer
from rayfed.tasks import Task
from rayfed.types import Batch

log = logging.getLogger(__name__)


def mixed_precision(device: torch.device, cache_enabled: bool = True) -> torch.autocast:
    """bf16 autocast on a GPU; nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda", cache_enabled=cache_enabled)




class GraphedStep:
    """One training step (forward, loss, backward, optimizer step) of one model, trained set, task and batch
    shape, captured once as a CUDA graph and replayed for every client that trains the same set.

    The steps of a foundation model with small adapters are bound by kernel launches (about a thousand
    per step); a replay launches them all at once. Each train call loads the client's values into the
    same parameter tensors and zeroes the optimizer's state in place, which is where a fresh optimizer
    starts; each batch is copied into the static inputs the graph reads.
    """

    def __init__(self, model: TrainableModule, named: dict[str, torch.Tensor], config: TrainConfig, lr: float,
                 batch: Batch, task: Task):
        self.optimizer = build_optimizer(config, list(named.values()), lr, capturable=True)
        self.forward = trained_forward(model, config)
        self.batch = {name: column.clone() for name, column in batch.items()}
        self.task = task
        device = next(iter(self.batch.values())).device
        start = {name: param.detach().clone() for name, param in named.items()}
        try:
            side = torch.cuda.Stream(device)  # warm-up off the default stream, as graph capture requires
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*capturable=True.*")  # uncaptured warm-up steps
                for _ in range(3):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._forward_backward_step()
            torch.cuda.current_stream(device).wait_stream(side)
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self._forward_backward_step()
        finally:
            with torch.no_grad():  # undo the warm-up's steps
                for name, param in named.items():
                    param.copy_(start[name])

    def _forward_backward_step(self) -> torch.Tensor:
        device = next(iter(self.batch.values())).device
        with mixed_precision(device, cache_enabled=False):  # no cast cache under capture
            loss = self.task.kind.loss(self.forward(self.batch), self.batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach().float()

    def reset_optimizer(self) -> None:
        for state in self.optimizer.state.values():
            for value in state.values():
                value.zero_()

    def step(self, batch: Batch) -> torch.Tensor:
        """One step on ``batch``; returns its loss (a tensor on the GPU, valid until the next step)."""
        for name, column in batch.items():
            self.batch[name].copy_(column, non_blocking=True)
        self.graph.replay()
        return self.loss


@dataclass(frozen=True)
class CompiledForward:
    """A model's ``torch.compile``, kept in its attachments: a submodule of its model it must not become."""

    module: nn.Module


def trained_forward(model: TrainableModule, config: TrainConfig) -> nn.Module:
    """What a training step calls: ``model``, or with ``train.compile`` its ``torch.compile``, built once per model.

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
        compiled = model.attachments.put(CompiledForward(torch.compile(model)))
    return compiled.module


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


def graphed_step(model: TrainableModule, named: dict[str, torch.Tensor], config: TrainConfig, lr: float,
                  data: ClientData, task: Task) -> GraphedStep | None:
    """The model's graph for this trained set, task (the forward path: heads, label space), batch shape
    and optimizer (captured on first use, the least recently used of :data:`MAX_GRAPHS_PER_MODEL`
    dropped), its optimizer state zeroed; None when the step cannot be captured (it then runs eagerly)."""
    part: TaskData = data.parts[0]
    batch_size = min(config.batch_size, data.num_train)
    shapes = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in part.train.items())
    key = (tuple(named), task.index, batch_size, shapes, config.optimizer, config.weight_decay, lr)
    graphs = _GRAPHS.setdefault(model, {})
    if key in graphs:
        graphs[key] = graphs.pop(key)  # most recently used last
    else:
        if len(graphs) == MAX_GRAPHS_PER_MODEL:
            del graphs[next(iter(graphs))]
        device = next(iter(named.values())).device
        try:
            graphs[key] = GraphedStep(model, named, config, lr,
                                      {name: column[:batch_size].to(device) for name, column in part.train.items()}, task)
        except RuntimeError as err:  # e.g. a forward that reads a value back to the host mid-step
            log.warning("train.cuda_graphs: the training step of this %s could not be captured as a CUDA graph "
                        "(%s); it trains eagerly.", type(model).__name__, str(err).splitlines()[0])
            graphs[key] = None
    if graphs[key] is not None:
        graphs[key].reset_optimizer()
    return graphs[key]
