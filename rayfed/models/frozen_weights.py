"""Frozen linear and convolution weights kept in bf16 on a GPU, where every step computes them in bf16 anyway.

Under bf16 autocast a linear layer casts its float32 weight to bf16 at every call, and autocast keeps such a cast
only for weights that require grad: a frozen backbone's weights are cast again at every forward, every micro-batch,
a copy kernel each (a fifth of a paper-size update's GPU time, and a third of its launches, in the profiles of
benchmarks/README.md). Stored in bf16 once, they give the same bf16 values, rounded the same way, so the products
are unchanged. Only ``nn.Linear`` and ``nn.Conv2d`` layers (their exact types) are stored so: what reads its weight
elsewhere than in autocast's matrix products (embeddings, norms, subclasses with a forward of their own) keeps
float32. The backbone outlives a method on its actor, and the next method may train a weight this one froze, so
each stored weight's float32 values wait on the host and :meth:`FrozenWeights.restore` puts them back.
"""

from __future__ import annotations

import torch
from torch import nn

_STORED_TYPES = (nn.Linear, nn.Conv2d)


class FrozenWeights:
    """The frozen layer weights one model stores in bf16, and their float32 values to restore."""

    def __init__(self) -> None:
        self._float32: list[tuple[nn.Parameter, torch.Tensor]] = []

    def store_in_bf16(self, model: nn.Module, device: torch.device, autocast: str) -> int:
        """On a GPU with ``train.autocast`` ``bf16``: store every frozen float32 weight and bias of ``model``'s
        linear and convolution layers in bf16 (the rest of the time nothing); returns how many tensors it stored."""
        if device.type != "cuda" or autocast != "bf16":
            return 0
        seen = {id(param) for param, _ in self._float32}
        for module in model.modules():
            if type(module) not in _STORED_TYPES:
                continue
            for param in (module.weight, module.bias):
                if param is None or param.requires_grad or param.dtype != torch.float32 or id(param) in seen:
                    continue
                seen.add(id(param))
                self._float32.append((param, param.detach().to("cpu", copy=True)))
                param.data = param.data.to(torch.bfloat16)
        return len(self._float32)

    def restore(self) -> None:
        """Every stored weight back to its float32 values, as they were before :meth:`store_in_bf16`."""
        for param, values in self._float32:
            param.data = values.to(param.device)
        self._float32.clear()
