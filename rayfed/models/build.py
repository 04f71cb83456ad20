"""Client and task models: a private copy of the backbone, heads by task kind, and the configured module."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.models.peft import named_adapters
from rayfed.models.peft.attach import _attach_module, _seeds
from rayfed.models.backbone import Backbone
from rayfed.models.client import ClientModel
from rayfed.models.peft.modules import task_heads
from rayfed.seeding import SERVER, torch_seed
from rayfed.tasks import Task


def classification_task(num_classes: int) -> Task:
    """The run's one task of the default image -> label path, with ``num_classes`` classes."""
    return Task(0, "task", ("",) * num_classes)


def build_client_model(
    backbone: Backbone, config: ModelConfig, task: Task | int, seed: int, private_copy: bool = True,
) -> ClientModel:
    """A fresh client model for one task over a private copy of ``backbone`` (``private_copy=False``: over
    ``backbone`` itself, which it changes); initial values depend on ``seed`` only. An int ``task`` is an
    image classification task with that many classes."""
    task = classification_task(task) if isinstance(task, int) else task
    torch.manual_seed(seed)
    head = task.kind.build_head(backbone, task) or nn.Identity()
    model = ClientModel(_private_copy(backbone) if private_copy else backbone, head, [task])
    _attach_module(model, backbone, config, [task], lambda block: False, seed)
    model.head.requires_grad_(True)
    return model


def build_task_model(
    backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
    dedicated: Callable[[int], bool] | None = None,
) -> ClientModel:
    """A client model over every task: one head per task (``head.task_<i>``) and ``config.module``, on
    each block shared by all tasks or, where ``dedicated(block)``, one copy per task. With one task and
    no dedicated blocks: :func:`build_client_model` (one ``head``)."""
    if len(tasks) == 1 and dedicated is None:
        return build_client_model(backbone, config, tasks[0], seed)
    dedicated = dedicated or (lambda block: False)
    if config.module in ("lora", "full", "bias", "prompt") and any(
            dedicated(block) for block in range(num_blocks(backbone))):
        raise ConfigError(
            f"model.module = {config.module!r} cannot have a copy per task; per-task modules are adapter, vpt or head."
        )
    torch.manual_seed(seed)
    model = ClientModel(_private_copy(backbone), nn.Identity(), tasks)
    model.head = task_heads(backbone, tasks, _seeds(seed))
    _attach_module(model, backbone, config, tasks, dedicated, seed)
    model.head.requires_grad_(True)
    return model


def build_lora_set(backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
                   adapters: Sequence[str], *, stream: str, owner: str, frozen: Sequence[str] = (),
                   attach: Callable[[nn.Module, Callable[[str], int]], named_adapters.Placement] | None = None,
                   ) -> ClientModel:
    """The task model with named conventional-LoRA ``adapters`` on the backbone's ``model.lora.targets`` (default:
    the family's), rank and scale from ``model.lora``, ``frozen`` of them not trained; its placement in the model's
    attachments. The adapters' initial values come from the random stream ``<stream>:<module>`` of ``seed``, the
    same on every actor. ``owner``: who trains the adapters, as a sentence names it (e.g. ``methods (fedsim)``).
    ``attach(encoder, seed_of)``: puts other adapters on the encoder instead, initial values from ``seed_of(module)``,
    and returns their placement."""
    lora = config.lora
    if lora is None:
        raise ConfigError(f"{owner} trains LoRA adapters: set model.lora (rank, alpha, targets).")
    model = build_task_model(backbone, config.model_copy(update={"module": "head", "lora": None}), tasks, seed)

    def seed_of(purpose: str) -> int:
        return torch_seed(seed, 0, SERVER, f"{stream}:{purpose}")

    try:
        if attach is None:
            placement = named_adapters.attach(
                model.encoder, named_adapters.lora(lora.rank, adapters, scale=lora.alpha / lora.rank, frozen=frozen),
                scope=backbone.lora_scope, targets=lora.targets or backbone.lora_targets, seed_of=seed_of)
        else:
            placement = attach(model.encoder, seed_of)
    except ValueError as err:
        raise ConfigError(f"{owner} on model.backbone = {backbone.name!r}: {err}.") from None
    model.attachments.put(placement)
    return model


def _private_copy(backbone: Backbone) -> Backbone:
    return dataclasses.replace(backbone, encoder=copy.deepcopy(backbone.encoder))


def num_blocks(backbone: Backbone) -> int:
    """The number of transformer blocks of an HF backbone (0 if it has no HF config)."""
    return getattr(getattr(backbone.encoder, "config", None), "num_hidden_layers", 0)


def check_image_channels(num_channels: int, backbone: Backbone) -> None:
    if num_channels not in (1, backbone.num_channels):
        raise ConfigError(
            f"data has {num_channels}-channel images but model.backbone expects {backbone.num_channels}; "
            "only 1-channel images are converted automatically."
        )
