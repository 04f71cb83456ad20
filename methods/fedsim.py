"""FedSim (Pillutla et al., ICML 2022, partial model personalization): a personal and a shared LoRA adapter on
every linear layer, trained together; only the shared one is averaged (sample-weighted, within an architecture)
and replaced every round.

A baseline of FedMosaic's paper, *Not All Clients Are Equal: Collaborative Model Personalization on Heterogeneous
Multi-Modal Clients* (docs/fedmosaic.md#ablations-baselines; the paper gives no details, this is our reading). The
layer's output is ``W x + s (B_p A_p x + B_s A_s x)`` (:mod:`rayfed.models.peft.named_adapters`, conventional LoRA, no
gate); both adapters take one optimizer step per batch (simultaneous update) and the shared one starts each round from
the received average.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from rayfed.config import ModelConfig
from rayfed.method import Method
from rayfed.models import Backbone, build_lora_set
from rayfed.models.peft import named_adapters
from rayfed.param_names import adapter_of
from rayfed.params import NonNegative, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task

PERSONAL, SHARED = "personal", "shared"


@hyperparameters
class FedSimParams:
    personal_scale: NonNegative = 1.0  # the personal adapter's weight in the sum (1: the plain sum)


@register_method("fedsim")
class FedSim(Method):
    Params = FedSimParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        model = build_lora_set(backbone, config, tasks, seed, (PERSONAL, SHARED), stream="fedsim",
                               owner="methods (fedsim)")
        if self.params.personal_scale != 1.0:
            named_adapters.set_mix(model, {PERSONAL: self.params.personal_scale, SHARED: 1.0})
        return model

    def is_shared(self, name: str) -> bool:
        return adapter_of(name) == SHARED
