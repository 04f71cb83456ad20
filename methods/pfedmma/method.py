"""pFedMMA: personalized federated learning with multi-modal adapters on CLIP.

*pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for Vision-Language Models*;
docs/pfedmma.md#the-method. Every block from ``first_layer`` to the last, in both towers, gets a parallel adapter
(:mod:`rayfed.methods.pfedmma.adapter`): local down/up projections per tower and one r x r projection shared by both
towers. Only the shared projections are communicated; the server takes their sample-count weighted mean over the
round's participants and every client (participant or not) is evaluated with the new global value. Round 0 trains all
clients (``first_round_all``).

``variant`` selects the paper's ablations: ``all_global`` (Baseline 1: every adapter tensor is FedAvg'd),
``shared_personal`` (Baseline 2: down/up global, shared personal), the untied ``vision_only`` /
``text_only`` / ``both`` (one r x r per tower; FedAvg the image one, the text one, or both), and
``local_only`` (E.2: nothing is communicated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from rayfed.models.families.clip import build_classifier
from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.method import Method
from rayfed.methods.pfedmma.adapter import TOWERS, MultiModalAdapter, attach
from rayfed.models import Backbone
from rayfed.params import AtLeastOne, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task

# Which adapter parameters (by name under ``adapter.``) each variant communicates.
Variant = Literal["pfedmma", "all_global", "shared_personal", "vision_only", "text_only", "both", "local_only"]
VARIANTS: dict[Variant, tuple[str, ...]] = {
    "pfedmma": ("shared.",),
    "all_global": ("",),
    "shared_personal": ("image_down.", "image_up.", "text_down.", "text_up."),
    "vision_only": ("image_shared.",),
    "text_only": ("text_shared.",),
    "both": ("image_shared.", "text_shared."),
    "local_only": (),
}
UNTIED_VARIANTS = ("vision_only", "text_only", "both")


@hyperparameters
class PFedMMAParams:
    rank: AtLeastOne = 32  # r, the shared projection's size
    first_layer: AtLeastOne = 10  # l: blocks l..L (numbered from 1) of both towers are adapted
    alpha: Positive = 0.005  # residual scale of the adapter branch
    grad_scale: bool = True  # adapter gradients scaled by 1/alpha (the gradient-scale layer)
    variant: Variant = "pfedmma"
    first_round_all: bool = True  # round 0 trains every client, whatever the sampling


@register_method("pfedmma")
class PFedMMA(Method):
    Params = PFedMMAParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        model = build_classifier(config, [task.class_names for task in tasks])
        depths = {tower: len(model.blocks(tower)[0]) for tower in TOWERS}
        if depths["image"] != depths["text"]:
            raise ConfigError(
                f"pfedmma adapts the same blocks of both towers, but model.backbone = {config.backbone!r} has "
                f"{depths['image']} image and {depths['text']} text blocks."
            )
        depth = depths["image"]
        if self.params.first_layer > depth:
            raise ConfigError(
                f"methods (pfedmma).first_layer = {self.params.first_layer} is beyond the last block of "
                f"model.backbone = {config.backbone!r}; allowed: 1..{depth}."
            )
        torch.manual_seed(seed)  # every client starts from the same adapter initialization
        model.adapter = MultiModalAdapter(
            model.widths(), self.params.rank, range(self.params.first_layer, depth + 1), self.params.alpha,
            tied=self.params.variant not in UNTIED_VARIANTS, grad_scale=self.params.grad_scale,
        )  # fmt: skip
        for tower in TOWERS:
            attach(model.adapter, tower, *model.blocks(tower))
        return model

    def is_shared(self, name: str) -> bool:
        local_name = name.removeprefix("adapter.")
        return any(local_name.startswith(prefix) for prefix in VARIANTS[self.params.variant])

    def participants(self, round_idx: int, sampled: list[int], num_clients: int) -> list[int]:
        if round_idx == 0 and self.params.first_round_all:
            return list(range(num_clients))
        return sampled
