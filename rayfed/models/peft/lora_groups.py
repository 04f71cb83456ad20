"""Several LoRA adapters in one forward: the batch holds each adapter's rows one group after the other, and every
LoRA factor multiplies each group's rows by that group's own values (a batched product), so the frozen backbone's
products run once over all the groups' rows. Each group's outputs, and the gradient toward each adapter's values,
are what a forward with that adapter alone gives, up to the order of floating-point sums.

It needs every value to be a LoRA factor (a bias-free linear ``lora_A`` / ``lora_B`` of peft, whose inputs keep the
batch's rows on their first axis) and no active dropout (its masks would be drawn differently from one adapter's
forward at a time); :func:`groupable` says whether a model and a set of values qualify.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from rayfed.param_names import components, leaf, parent
from rayfed.types import TensorDict


def _factor(model: nn.Module, name: str) -> nn.Linear | None:
    """The bias-free LoRA factor whose weight ``name`` is, else None."""
    module_name = parent(name)
    if leaf(name) != "weight" or not any(part in ("lora_A", "lora_B") for part in components(module_name)):
        return None
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return module if type(module) is nn.Linear and module.bias is None else None


def _has_dropout(model: nn.Module) -> bool:
    """Any active dropout: a dropout module, or an attention's dropout rate (Hugging Face's attentions)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        if any(isinstance(rate := getattr(module, attr, 0.0), float) and rate > 0
               for attr in ("attention_dropout", "dropout")):
            return True
    return False


def groupable(model: nn.Module, names: Sequence[str]) -> bool:
    """Whether adapters with values ``names`` can run grouped through ``model`` (:func:`grouped_lora`)."""
    return bool(names) and all(_factor(model, name) is not None for name in names) and not _has_dropout(model)


@contextmanager
def grouped_lora(model: nn.Module, adapters: Sequence[TensorDict]) -> Iterator[None]:
    """Within the block, ``model``'s forward on a batch of ``len(adapters) * n`` rows runs rows ``[g * n, (g + 1)
    * n)`` with ``adapters[g]``'s LoRA factors (each adapter: the same names, :func:`groupable`); the gradient
    reaches each adapter's own tensors."""
    factors = {name: _factor(model, name) for name in adapters[0]}
    groups = len(adapters)
    for name, module in factors.items():
        stacked = torch.stack([adapter[name] for adapter in adapters])  # [groups, out, in]

        def forward(x: torch.Tensor, weight: torch.Tensor = stacked) -> torch.Tensor:
            grouped = x.reshape(groups, -1, x.shape[-1])  # each group's rows, flattened over any middle axes
            return torch.matmul(grouped, weight.transpose(1, 2)).reshape(*x.shape[:-1], -1)

        module.forward = forward
    try:
        yield
    finally:
        for module in factors.values():
            del module.forward
