"""Extra loss terms a method declares safe to capture in a CUDA graph with its step (:class:`TensorPenalty`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from rayfed.types import TensorDict

PenaltyTerm = Callable[..., torch.Tensor]


class TensorPenalty:
    """An extra loss term a method declares safe to capture in a CUDA graph with its step (``train.cuda_graphs``):
    ``term(params, inputs, *settings)``, pure tensor work on the live trained tensors (``params``, by name) and the
    tensors ``inputs`` (slots of named tensors: the received global model, ...), its Python numbers in ``settings``.

    ``term`` must not read a value back to the host, branch on one, or keep state between calls; it is a function of
    its arguments alone (a closure, which could hold other tensors, is refused). A captured step reads copies of
    ``inputs`` that each train call refills, and serves only penalties with the same ``term``, ``settings`` and input
    shapes. Any other penalty (a plain function of the parameters) runs the step eagerly, which is the safe default.
    """

    def __init__(self, term: PenaltyTerm, inputs: dict[str, TensorDict], settings: tuple[float, ...] = ()):
        if getattr(term, "__closure__", None):
            raise TypeError(f"TensorPenalty's term {term.__qualname__} closes over variables of its surroundings; "
                            "pass the tensors it reads as inputs and its numbers as settings.")
        self.term, self.inputs, self.settings = term, inputs, tuple(settings)
        self._on_device: dict[torch.device, dict[str, TensorDict]] = {}

    def __call__(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        device = next(iter(params.values())).device
        if device not in self._on_device:  # inputs arrive on the CPU; moved once, not every step
            self._on_device[device] = {slot: {name: value.to(device) for name, value in values.items()}
                                       for slot, values in self.inputs.items()}
        return self.term(params, self._on_device[device], *self.settings)

    def key(self) -> tuple:
        """What a captured step bakes in: the term, its settings and its inputs' names, shapes and dtypes."""
        specs = tuple((slot, tuple((name, tuple(value.shape), value.dtype) for name, value in values.items()))
                      for slot, values in self.inputs.items())
        return self.term, self.settings, specs
