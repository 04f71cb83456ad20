"""A model's forward compiled with ``torch.compile`` (``train.compile``), built once per model and kept with it."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from rayfed.config import TrainConfig
from rayfed.models.client import TrainableModule
from rayfed.training.patch_matmul import PatchMatmul

log = logging.getLogger(__name__)


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

