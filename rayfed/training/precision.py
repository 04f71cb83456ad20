"""What a step or an evaluation computes in: bf16 autocast on a GPU (``train.autocast``), and the check that a model
stored in half precision is not asked for float32 steps."""

from __future__ import annotations

import torch
from torch import nn

from rayfed.config import TrainConfig
from rayfed.errors import ConfigError


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

