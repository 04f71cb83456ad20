"""What a step or an evaluation computes in: bf16 autocast on a GPU (``train.autocast``), and the check that a model
stored in half precision is not asked for float32 steps."""

from __future__ import annotations

import torch
from torch import nn

from rayfed.config import TrainConfig
from rayfed.errors import ConfigError


AUTOCAST_DEVICES = frozenset({"cuda"})
"""The device types on which ``train.autocast: bf16`` takes effect. A CPU computes in float32 (the offline numbers are
float32's); tests add ``cpu`` to run a GPU's precision there, its bf16-stored frozen weights included."""


def computes_in_bf16(device: torch.device, autocast: str) -> bool:
    """Whether steps and evaluations on ``device`` run under bf16 autocast: ``train.autocast`` ``autocast`` = ``bf16``
    on a GPU. Where they do, a method's frozen linear and convolution weights are stored in bf16
    (:class:`rayfed.models.frozen_weights.FrozenWeights`), so every forward of its model must run under
    :func:`mixed_precision`."""
    return device.type in AUTOCAST_DEVICES and autocast == "bf16"


def mixed_precision(device: torch.device, autocast: str, cache_enabled: bool = True) -> torch.autocast:
    """What a step or evaluation on ``device`` computes in: with ``train.autocast`` ``autocast`` = ``bf16``, bf16
    autocast on a GPU; with ``off``, and on the CPU, nothing (float32). Disabled, it is a CUDA autocast, which leaves
    a CPU autocast entered around it as it is."""
    enabled = computes_in_bf16(device, autocast)
    return torch.autocast(device.type if enabled else "cuda", dtype=torch.bfloat16, enabled=enabled,
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

