"""FedSim (Pillutla et al., ICML 2022, partial model personalization): a personal and a shared LoRA adapter on
every linear layer, trained together; only the shared one is averaged (sample-weighted, within an architecture)
and replaced every round.

A baseline of FedMosaic's paper (seed ``001_341533e252d11d6f.txt`` §5; spec ``fedmosaic.md`` §6 [interp]). The
layer's output is ``W x + s (B_p A_p x + B_s A_s x)`` (:mod:`rayfed.pqlora`, conventional LoRA, no gate); both
adapters take one optimizer step per batch (simultaneous update) and the shared one starts each round from the
received average.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from rayfed import pqlora, seeding
from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.method import Method
from rayfed.models import Backbone, build_task_model
from rayfed.registry import register_method
from rayfed.tasks import Task

PERSONAL, SHARED = "personal", "shared"


@dataclass(frozen=True)
class FedSimParams:
    personal_scale: float = 1.0  # the personal adapter's weight in the sum (1: the plain sum)

    def __post_init__(self) -> None:
        if self.personal_scale < 0:
            raise ValueError("personal_scale must be >= 0")


def build_lora_set(method: str, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
                   adapters: Sequence[str], frozen: Sequence[str] = (), gate: bool = False) -> nn.Module:
    """The task model with named conventional-LoRA ``adapters`` on the backbone's ``model.lora.targets`` (default:
    the family's), rank and scale from ``model.lora``; the same initial values on every actor."""
    lora = config.lora
    if lora is None:
        raise ConfigError(f"methods ({method}) trains LoRA adapters: set model.lora (rank, alpha, targets).")
    model = build_task_model(backbone, config.model_copy(update={"module": "head", "lora": None}), tasks, seed)
    try:
        model.adapter_placement = pqlora.attach(
            model.encoder, rank=lora.rank, adapters=adapters, scale=lora.alpha / lora.rank, frozen=frozen, gate=gate,
            scope=backbone.lora_scope, targets=lora.targets or backbone.lora_targets,
            seed_of=lambda purpose: seeding.torch_seed(seed, 0, seeding.SERVER, f"{method}:{purpose}"))
    except ValueError as err:
        raise ConfigError(f"methods ({method}) on model.backbone = {backbone.name!r}: {err}.") from None
    return model


@register_method("fedsim")
class FedSim(Method):
    Params = FedSimParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        model = build_lora_set("fedsim", backbone, config, tasks, seed, (PERSONAL, SHARED))
        if self.params.personal_scale != 1.0:
            pqlora.set_mix(model, {PERSONAL: self.params.personal_scale, SHARED: 1.0})
        return model

    def is_shared(self, name: str) -> bool:
        return f".{SHARED}_" in name
