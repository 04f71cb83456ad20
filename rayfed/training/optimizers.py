"""Optimizers and learning-rate schedules of local training, and an optimizer's state as plain tensors."""

from __future__ import annotations

import math

import torch

from rayfed.config import TrainConfig
from rayfed.types import TensorDict


def local_steps(config: TrainConfig, num_train: int) -> int:
    """Steps of one local update: ``local_steps``, or ``local_epochs`` passes over the client's data."""
    if config.local_epochs is not None:
        return config.local_epochs * math.ceil(num_train / (config.batch_size * config.grad_accum))
    return config.local_steps


def scheduled_lr(config: TrainConfig, base_lr: float, round_idx: int, global_step: int) -> float:
    """``warmup_cosine``: linear warm-up to ``base_lr`` over ``warmup_steps``, then cosine decay to 0 at
    ``decay_steps`` global steps; ``round_warmup``: linear from ``warmup_start_lr`` at round 0 to ``base_lr``
    at round ``warmup_rounds``, then constant."""
    if config.schedule == "round_warmup":
        progress = min(round_idx / config.warmup_rounds, 1.0)
        return config.warmup_start_lr + (base_lr - config.warmup_start_lr) * progress
    if global_step < config.warmup_steps:
        return base_lr * (global_step + 1) / config.warmup_steps
    span = max(config.decay_steps - config.warmup_steps, 1)
    progress = min((global_step - config.warmup_steps) / span, 1.0)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    config: TrainConfig, params: list[torch.Tensor] | list[dict], lr: float | torch.Tensor, capturable: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``train.optimizer`` names over ``params``; ``lr`` a tensor on the device for a captured step,
    which reads the rate it holds at each replay (with ``capturable``: Adam's step count on the device too; torch's
    fused SGD runs under capture as it is)."""
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    # One fused kernel per step on the GPU instead of a few per tensor: the steps are launch-bound. Elsewhere the
    # foreach update: the same operations on each tensor, bitwise, looped in C++ rather than in Python (torch's
    # default off a GPU), which a CPU step of a small model's many LoRA tensors otherwise waits on.
    fused = all(p.is_cuda for p in tensors) or None
    foreach = None if fused else True
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay, fused=fused,
                               foreach=foreach)
    adam = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return adam(params, lr=lr, weight_decay=config.weight_decay, fused=fused, foreach=foreach, capturable=capturable)


def saved_optimizer_state(optimizers: list[torch.optim.Optimizer], named: dict[str, torch.Tensor]) -> TensorDict:
    """Every optimizer's per-parameter state as plain tensors named ``<phase>/<parameter>/<key>``."""
    name_of = {id(p): n for n, p in named.items()}
    state: TensorDict = {}
    for phase, optimizer in enumerate(optimizers):
        for param, values in optimizer.state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    state[f"{phase}/{name_of[id(param)]}/{key}"] = value.detach().clone()
    return state


def load_optimizer_state(optimizers: list[torch.optim.Optimizer], named: dict[str, torch.Tensor],
                         state: TensorDict) -> None:
    """Loads what :func:`saved_optimizer_state` saved into optimizers over the same parameters."""
    by_parameter: dict[str, dict[str, torch.Tensor]] = {}  # "<phase>/<name>" -> its values, in one pass over state
    for key, value in state.items():
        parameter, _, field = key.rpartition("/")
        by_parameter.setdefault(parameter, {})[field] = value
    names = {id(p): n for n, p in named.items()}
    for phase, optimizer in enumerate(optimizers):
        saved = optimizer.state_dict()
        order = [id(p) for group in optimizer.param_groups for p in group["params"]]
        per_param: dict[int, dict] = {}
        for position, param_id in enumerate(order):
            values = by_parameter.get(f"{phase}/{names[param_id]}")
            if values:
                per_param[position] = values
        optimizer.load_state_dict({"state": per_param, "param_groups": saved["param_groups"]})

