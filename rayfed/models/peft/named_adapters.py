"""Named, mixed low-rank adapters on the linear layers of a transformer's decoder layers.

Every adapted linear layer ``W`` becomes an :class:`AdaptedLinear` holding one or more named adapters (e.g. a
``personal`` and a ``shared`` one), each conventional LoRA ``s B_a A_a x`` with ``A_a`` (r x d_in) and ``B_a``
(d_out x r) of its own, whose outputs the layer's ``mix`` combines: a plain sum, or any weights a method sets (per
instance, too). Parameter names: ``<linear>.<adapter>_A`` / ``_B``. Every one of them is a per-client value
(``requires_grad``: it lives in client state and is swapped in per client); a method's training phases choose which
of them train. Frozen adapters (``frozen``) are detached in the forward pass, so no gradient is computed for them.

A method may bring its own adapter form by subclassing :class:`AdaptedLinear` (its parameters, its mixed output) and
placing it with :func:`attach`; :func:`set_mix` and :func:`adapters_off` work on every subclass.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rayfed.param_names import adapter_param, leaf, parent

LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_BLOCK_SCALES = 8  # the mixes of numbers a layer keeps its block scales for (a method uses one or two)

Mix = Mapping[str, float | torch.Tensor]


class AdaptedLinear(nn.Module):
    """A frozen linear layer plus named conventional-LoRA adapters (see the module docstring)."""

    def __init__(self, base: nn.Linear, rank: int, adapters: Sequence[str], *, scale: float,
                 frozen: Collection[str] = (), generator: torch.Generator | None = None):
        super().__init__()
        self.base = base
        self.adapters = tuple(adapters)
        self.rank = rank
        self.scale = scale
        self.frozen = frozenset(frozen)
        self.enabled = True
        self.mix: Mix | None = None  # None: the layer's default weights (a plain sum)
        self.block_scales: dict[tuple, torch.Tensor] = {}  # by mix of numbers, dtype and device (_block_scale)
        d_out, d_in = base.weight.shape
        device = base.weight.device
        generator = generator if generator is not None else torch.Generator().manual_seed(0)
        if device.type == "meta":  # shapes only (parameter counts of models too large to build)
            for name, shape in self._parameter_shapes(d_in, d_out):
                setattr(self, name, nn.Parameter(torch.empty(*shape, device="meta")))
            return
        self._create_parameters(d_in, d_out, device, generator)

    def _parameter_shapes(self, d_in: int, d_out: int) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter's name and shape, in the order :meth:`_create_parameters` creates them."""
        return [(adapter_param(name, part), shape) for name in self.adapters
                for part, shape in (("A", (self.rank, d_in)), ("B", (d_out, self.rank)))]

    def _create_parameters(self, d_in: int, d_out: int, device: torch.device, generator: torch.Generator) -> None:
        a = torch.empty(self.rank, d_in)
        bound = 1.0 / math.sqrt(d_in)  # kaiming_uniform(a=sqrt(5)), peft's and nn.Linear's default
        a.uniform_(-bound, bound, generator=generator)
        for name in self.adapters:  # every adapter starts from the same values
            setattr(self, adapter_param(name, "A"), nn.Parameter(a.clone().to(device)))
            setattr(self, adapter_param(name, "B"), nn.Parameter(torch.zeros(d_out, self.rank, device=device)))

    def adapter(self, name: str, part: str) -> torch.Tensor:
        value = getattr(self, adapter_param(name, part))
        return value.detach() if name in self.frozen else value

    def weights(self) -> Mix:
        """Each adapter's weight: ``mix`` where a method set one, else the layer's default (a plain sum)."""
        return self.mix if self.mix is not None else {name: 1.0 for name in self.adapters}

    def delta_weight(self, name: str) -> torch.Tensor:
        """Adapter ``name``'s ``Delta W`` (d_out x d_in)."""
        return self.scale * self.adapter(name, "B") @ self.adapter(name, "A")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if not self.enabled:
            return out
        delta = self.delta(x)
        return out if delta is None else out + delta

    def delta(self, x: torch.Tensor) -> torch.Tensor | None:
        """The adapters' output on ``x``, mixed by :meth:`weights`; None when every weight is 0."""
        active = [(name, w) for name, w in self.weights().items() if not (isinstance(w, (int, float)) and w == 0)]
        if not active:
            return None
        scalar = all(not isinstance(w, torch.Tensor) or w.dim() == 0 for _, w in active)
        return self._mixed(x, active, scalar)

    def _mixed(self, x: torch.Tensor, active: list[tuple[str, float | torch.Tensor]], scalar: bool) -> torch.Tensor:
        """The ``active`` adapters' weighted output (``scalar``: every weight one number, else per row)."""
        if len(active) == 1:
            name, w = active[0]
            delta = nn.functional.linear(nn.functional.linear(x, self.adapter(name, "A")), self.adapter(name, "B"))
            return (self.scale * w) * delta
        # Several adapters in two products: x [A_1; A_2]^T, each r-block scaled by its weight, times [B_1, B_2]^T.
        a = torch.cat([self.adapter(name, "A") for name, _ in active])
        b = torch.cat([self.adapter(name, "B") for name, _ in active], dim=1)
        code = nn.functional.linear(x, a)
        if all(isinstance(w, (int, float)) for _, w in active):
            return self.scale * nn.functional.linear(code * self._block_scale(active, code), b)
        weights = [torch.as_tensor(w, dtype=code.dtype, device=code.device) for _, w in active]
        if scalar:
            scale = torch.stack(weights).repeat_interleave(self.rank)
        else:
            shape = next(w.shape for w in weights if w.dim())
            scale = torch.cat([w.expand(*shape[:-1], self.rank) for w in weights], dim=-1)
        return self.scale * nn.functional.linear(code * scale, b)

    def _block_scale(self, active: list[tuple[str, float | torch.Tensor]], code: torch.Tensor) -> torch.Tensor:
        """Each adapter's number repeated over its rank's block, made once per mix, dtype and device: made at every
        forward, it was a copy from the host to the device in every layer, which a captured step cannot hold."""
        key = (tuple(w for _, w in active), code.dtype, code.device)
        if key not in self.block_scales:
            if len(self.block_scales) >= MAX_BLOCK_SCALES:
                self.block_scales.clear()
            self.block_scales[key] = torch.tensor([float(w) for _, w in active], dtype=code.dtype,
                                                  device=code.device).repeat_interleave(self.rank)
        return self.block_scales[key]


# (decoder layer index, 1-based, and the layer) -> what turns each of its target linears into an adapted one
LinearBuilder = Callable[[nn.Linear, torch.Generator], AdaptedLinear]
LayerBuilder = Callable[[int, nn.Module], LinearBuilder]


@dataclass(frozen=True)
class Placement:
    """Where adapters sit in one model: its decoder depth and every adapted module's qualified name (under the root
    module :func:`attach` was given) with its 1-based layer and linear name."""

    depth: int
    modules: tuple[tuple[str, int, str], ...]


def decoder_layers(root: nn.Module, scope: str | None = None) -> tuple[str, nn.ModuleList]:
    """The qualified name and the list of a transformer's decoder layers: the first ``nn.ModuleList`` named
    ``layers`` (``layer``) under ``scope`` (LLaVA: ``model.language_model``)."""
    for name, module in root.named_modules():
        if scope is not None and not name.startswith(scope + "."):
            continue
        if isinstance(module, nn.ModuleList) and leaf(name) in ("layers", "layer") and len(module):
            return name, module
    where = f" under {scope!r}" if scope else ""
    raise ValueError(f"the model has no list of decoder layers{where} (an nn.ModuleList named 'layers')")


def lora(rank: int, adapters: Sequence[str], *, scale: float, frozen: Collection[str] = ()) -> LayerBuilder:
    """The same conventional-LoRA ``adapters`` on every decoder layer (for :func:`attach`)."""
    def on_layer(index: int, layer: nn.Module) -> LinearBuilder:
        return lambda linear, generator: AdaptedLinear(linear, rank, adapters, scale=scale, frozen=frozen,
                                                       generator=generator)

    return on_layer


def attach(root: nn.Module, on_layer: LayerBuilder, *, scope: str | None = None,
           targets: Sequence[str] = LINEAR_TARGETS, seed_of: Callable[[str], int] = lambda purpose: 0) -> Placement:
    """Replace every ``targets`` linear layer of ``root``'s decoder layers by the :class:`AdaptedLinear` that
    ``on_layer(index, layer)`` (called once per decoder layer, before its linears) builds from it and a generator.
    Initial values depend on ``seed_of`` only (module by module), so every model built with it starts the same."""
    prefix, layers = decoder_layers(root, scope)
    placed = []
    for index, layer in enumerate(layers, start=1):
        build = on_layer(index, layer)
        for name, module in list(layer.named_modules()):
            attribute = leaf(name)
            if attribute not in targets or not isinstance(module, nn.Linear):
                continue
            generator = torch.Generator().manual_seed(seed_of(f"layer{index}:{name}"))
            setattr(layer.get_submodule(parent(name)), attribute, build(module, generator))
            placed.append((f"{prefix}.{index - 1}.{name}", index, attribute))
    missing = sorted(set(targets) - {attribute for _, _, attribute in placed})
    if missing:
        raise ValueError(f"the decoder layers have no linear layers named {', '.join(missing)}")
    return Placement(len(layers), tuple(placed))


def adapted_modules(model: nn.Module) -> Iterator[tuple[str, AdaptedLinear]]:
    for name, module in model.named_modules():
        if isinstance(module, AdaptedLinear):
            yield name, module


def set_mix(model: nn.Module, mix: Mix | None) -> None:
    """Make every adapted layer combine its adapters with ``mix`` (None: each layer's default)."""
    for _, module in adapted_modules(model):
        module.mix = None if mix is None else dict(mix)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its frozen pretrained self (every adapter branch off)."""
    modules = [module for _, module in adapted_modules(model)]
    previous = [module.enabled for module in modules]
    for module in modules:
        module.enabled = False
    try:
        yield
    finally:
        for module, enabled in zip(modules, previous):
            module.enabled = enabled
