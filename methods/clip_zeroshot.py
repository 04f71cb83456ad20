"""CLIP zero-shot: the frozen model with the prompt "a photo of a {class}.", evaluated only.

The reference point of the tables of *pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for
Vision-Language Models* (docs/pfedmma.md#baselines). No client trains and nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from rayfed.models.families.clip import build_classifier
from rayfed.config import ModelConfig
from rayfed.method import Method
from rayfed.registry import register_method
from rayfed.models import Backbone
from rayfed.tasks import Task


@register_method("clip_zeroshot")
class ClipZeroShot(Method):
    communicates = False

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        return build_classifier(config, [task.class_names for task in tasks])

    def participants(self, round_idx: int, sampled: list[int], num_clients: int) -> list[int]:
        return []
