"""A model's training forward with ``torch.compile`` (``train.compile``), built once per model and kept with it.

A foundation model is a stack of identical blocks (a transformer's layers). Compiling the whole model traces and
compiles every layer apart, which took minutes a model on a GPU host (ViLT's did not finish three rounds in 200 s);
compiled one block at a time, the layers of one class share one compilation (dynamo's cache is per code object,
and the parameters are the compiled code's inputs), so a model compiles in the time of one block, and every later
model built from the same classes (another method on the actor) reuses it. The code outside the blocks (embeddings,
heads, a method's loss) stays eager: a few kernels against the blocks' thousands.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch._dynamo.exc import TorchDynamoException
from torch._dynamo.utils import counters

from rayfed.config import TrainConfig
from rayfed.models.client import TrainableModule
from rayfed.training.patch_matmul import PatchMatmul

log = logging.getLogger(__name__)
# Blocks of one class compile once, but an attribute a block's forward reads (a layer's index) is guarded on, which
# makes a compilation per layer: allow a model of 64 such layers, each in train and eval mode, before giving up.
MIN_RECOMPILE_LIMIT = 128


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of every ``nn.ModuleList`` of ``model`` that holds two or more modules of one class, each made of
    modules of its own (a transformer's layers, not a list of heads); the outermost only."""
    blocks: list[nn.Module] = []
    inside: list[str] = []  # the names of the blocks found, whose submodules are part of them
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(name.startswith(f"{outer}.") for outer in inside):
            continue
        members = list(module)
        if (len(members) >= 2 and len({type(member) for member in members}) == 1
                and all(any(True for _ in member.children()) for member in members)):
            blocks.extend(members)
            inside.append(name)
    return blocks


class _CompiledBlock:
    """What a block's ``forward`` becomes: its compiled forward while its :class:`CompiledForward` trains, its own
    forward otherwise (evaluation, a teacher's pass outside the training step)."""

    def __init__(self, block: nn.Module, owner: CompiledForward):
        self.eager: Callable[..., object] = block.forward
        self.compiled = torch.compile(self.eager, dynamic=False)
        self.owner = owner

    def __call__(self, *args, **kwargs) -> object:
        return (self.compiled if self.owner.training else self.eager)(*args, **kwargs)


class CompiledForward:
    """A model's compiled training forward, kept in its attachments (a submodule of its model it must not become):
    its repeated blocks compiled (:func:`repeated_blocks`), or the whole model where it has none.

    Where a block's code stops tracing (a value read back to the host, Python the compiler cannot follow), it runs
    in pieces with that code eagerly between them, which the first call reports in one warning. Where compiling
    fails, it warns once and the model trains eagerly from then on; the step that failed restarts eagerly (its
    dropout draws are then not the eager run's)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.blocks = repeated_blocks(model)
        self.training = False
        if self.blocks:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, MIN_RECOMPILE_LIMIT)
            for block in self.blocks:
                block.forward = _CompiledBlock(block, self)
            log.info("train.compile: the %s compiles its %d blocks (%s) one class at a time.", type(model).__name__,
                     len(self.blocks), ", ".join(sorted({type(block).__name__ for block in self.blocks})))
            self.compiled: Callable[..., torch.Tensor] = model
        else:
            self.compiled = torch.compile(model)
        self.eager = False
        self.called = False

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.eager:
            return self.model(*args, **kwargs)
        breaks = set(counters["graph_break"])
        try:
            with self._training():
                outputs = self.compiled(*args, **kwargs)
        except TorchDynamoException as err:
            self._fall_back()
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

    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        self.training = True
        try:
            yield
        finally:
            self.training = False

    def _fall_back(self) -> None:
        self.eager = True
        for block in self.blocks:
            del block.forward  # the class's forward again


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
