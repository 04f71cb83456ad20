"""A method's frozen linear and convolution weights kept in bf16 where every forward computes them in bf16 anyway.

Under bf16 autocast (``train.autocast: bf16`` on a GPU) a linear layer or a convolution casts its float32 weight and
bias to bf16 at every call, and autocast keeps such a cast only for tensors that require grad: a frozen backbone's
weights are cast again at every forward of every micro-batch, a copy kernel each (16-26% of the GPU time of a
paper-size local update in the profiles of benchmarks/README.md), and the backward keeps the copies. Stored in bf16
once, they are the same bf16 values (a cast to bf16 rounds to nearest even, whether autocast or the store makes it),
so every product, output and gradient is bitwise what it was.

Stored: the weight and bias of every layer of exactly ``nn.Linear`` or ``nn.Conv2d`` type, where the tensor is frozen
(``requires_grad`` false) and float32. Not stored: trained tensors (autocast caches their casts, and an optimizer steps
them in float32); a tensor another kind of module holds too (an LM head tied to its token embeddings, which a lookup
reads outside autocast's products); subclasses (torch's attention output projection, which its fused kernel reads);
and every other module (embeddings, norms, a raw parameter read as ``x @ W``).

What it asks of the rest: every forward of the model runs under :func:`rayfed.training.mixed_precision` (a float32
activation would meet a bf16 weight: an error, not a silent change), and no code reads a stored tensor's values or
dtype but autocast's products. One library does read a dtype: open_clip's text transformer computes in its first
block's ``c_fc`` weight dtype unless the layer names its own as ``int8_original_dtype``; every stored layer names
float32 there, the dtype it computed in before.

The actor's backbone outlives a method, and the next method may train a weight this one froze: a stored tensor that
the backbone shares (a model built over the backbone itself rather than a copy of it) waits in float32 on the host,
and :meth:`FrozenWeights.restore` puts it back before the next method's model is built.
"""

from __future__ import annotations

import torch
from torch import nn

STORED_TYPES = (nn.Linear, nn.Conv2d)
ORIGINAL_DTYPE = "int8_original_dtype"  # open_clip's name for the dtype a layer's activations keep


def frozen_layer_tensors(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """Each tensor of ``model`` that :meth:`FrozenWeights.store_in_bf16` stores, with its layer (see the module
    docstring), once however many layers share it."""
    elsewhere = {id(param) for module in model.modules() if type(module) not in STORED_TYPES
                 for param in module.parameters(recurse=False)}
    found: list[tuple[nn.Module, nn.Parameter]] = []
    seen: set[int] = set()
    for module in model.modules():
        if type(module) not in STORED_TYPES:
            continue
        for param in (module.weight, module.bias):
            if (param is None or param.requires_grad or param.dtype != torch.float32 or id(param) in seen
                    or id(param) in elsewhere):
                continue
            seen.add(id(param))
            found.append((module, param))
    return found


class FrozenWeights:
    """The frozen layer tensors a method's model stores in bf16, and the float32 values of those the actor's backbone
    shares, to restore."""

    def __init__(self) -> None:
        self._kept: list[tuple[nn.Module, nn.Parameter, torch.Tensor]] = []

    def store_in_bf16(self, model: nn.Module, outliving: nn.Module) -> int:
        """Store every tensor of :func:`frozen_layer_tensors` of ``model`` in bf16, keeping on the host the float32
        values of those that ``outliving`` (the actor's backbone encoder) holds too; returns how many it stored. Only
        where every forward of ``model`` runs under bf16 autocast
        (:func:`rayfed.training.precision.computes_in_bf16`)."""
        shared = {id(param) for param in outliving.parameters()}
        tensors = frozen_layer_tensors(model)
        for module, param in tensors:
            if id(param) in shared:
                self._kept.append((module, param, param.detach().to("cpu", copy=True)))
            param.data = param.data.to(torch.bfloat16)
            setattr(module, ORIGINAL_DTYPE, torch.float32)
        return len(tensors)

    def restore(self) -> None:
        """Every stored tensor the backbone shares back to its float32 values, as before :meth:`store_in_bf16`."""
        for module, param, values in self._kept:
            param.data = values.to(param.device)
            if hasattr(module, ORIGINAL_DTYPE):
                delattr(module, ORIGINAL_DTYPE)
        self._kept.clear()
