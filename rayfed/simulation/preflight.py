"""The model preflight: before any actor starts, build every architecture's backbone and every method's model in the
driver process and run it, and its task's loss, on two samples of every task, so that a mistake fails here with one
sentence rather than inside an actor. A backbone of random weights whose builder can draw them on the meta device
(the paper-size ones, billions of weights) is checked from shapes: the methods' models are built on it and the task
kinds' checks run and two samples of every task are encoded; the forward runs on the actors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rayfed.architectures import architecture_names, architecture_of
from rayfed.config import RunConfig, architecture_model_config, method_model_config
from rayfed.data.clients import Federation
from rayfed.errors import ConfigError
from rayfed.method import Method, method_model
from rayfed.models import build_backbone
from rayfed.models.client_plugin import client_models_built
from rayfed.models.peft.modules import select_task
from rayfed.tasks import Task


def check_model(config: RunConfig, federation: Federation, methods: Sequence[Method]) -> None:
    """Build every architecture's backbone and every method's model once (seed 0) and run it, and its task's loss,
    on two samples of every task it holds (shapes only where the backbone's weights come out on the meta device); a
    method that cannot score a task no client holds is refused."""
    held = {holding.task for holding in federation.holdings}
    unheld = sorted({e.task for e in federation.shared} - held)
    of = architecture_of(config)
    for name in architecture_names(config):
        model_config = architecture_model_config(config, name)
        backbone = build_backbone(model_config, 0, "meta")
        shapes_only = any(p.is_meta for p in backbone.encoder.parameters())
        if name:
            backbone.config_field = f"architectures.{name}.backbone"
        clients = {c for c in range(federation.num_clients) if of[c] == name}
        restricted = federation.restricted_to(clients)
        restricted.check(backbone)
        samples = sample_batches(restricted, backbone)
        for index, (entry, method) in enumerate(zip(config.methods, methods)):
            method_config = method_model_config(model_config, entry, index)
            with client_models_built() as built:
                model = method_model(method, f"methods[{index}] ({entry.label})", backbone, method_config,
                                     federation.tasks, 0)
            if method_config.client is not None and not built:
                raise ConfigError(
                    f"methods[{index}] ({entry.label}) builds a model of its own and would ignore model.client = "
                    f"{method_config.client!r}; set methods[{index}].model.client: null, or choose a method that "
                    "trains the configured client model."
                )
            if unheld and not model.scores_unseen_tasks:
                raise ConfigError(
                    f"methods[{index}] ({entry.label}) scores a task with heads trained on clients' data and "
                    f"cannot score task(s) {unheld} that no client holds (a label space of data.partition's); use "
                    "a method that classifies by text, such as clip_zeroshot or promptfl "
                    "(`rayfed list` shows the others)."
                )
            for holding in restricted.holdings:
                federation.tasks[holding.task].kind.check_model(model, backbone, holding.where)
            if shapes_only:
                continue
            # bf16 weights (a backbone built where a GPU is seen) run here on the CPU, under autocast as on the GPU
            low_precision = any(p.dtype == torch.bfloat16 for p in model.parameters())
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=low_precision):
                for task, batch in samples:
                    select_task(model, task.index)
                    task.kind.loss(model(batch), batch)


def sample_batches(federation: Federation, backbone: Any, rows: int = 2) -> list[tuple[Task, dict[str, torch.Tensor]]]:
    """A few training samples of every task (from its first client), encoded for ``backbone``."""
    samples = []
    for holding in federation.holdings:
        train, _ = holding.splits[0]
        columns = federation._encode(holding, train[:rows], backbone)
        samples.append((federation.tasks[holding.task], columns))
    return samples
