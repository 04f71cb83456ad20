"""PromptFL: federated CoOp, learnable context vectors shared by all classes and all clients.

A baseline of *pFedMMA: Personalized Federated Fine-Tuning with Multi-Modal Adapter for Vision-Language Models*
(docs/pfedmma.md#baselines). The class prompt is
"[SOS] ctx_1 .. ctx_n {class name}. [EOS]": ``n_ctx`` vectors, N(0, ctx_std^2), take the place of the
first ``n_ctx`` word embeddings; only they are trained, and they are FedAvg'd (sample-count weighted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rayfed.models.families.clip import add_learnable_context, build_classifier
from rayfed.config import ModelConfig
from rayfed.method import Method
from rayfed.params import AtLeastOne, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.models import Backbone
from rayfed.tasks import Task


@hyperparameters
class PromptFLParams:
    n_ctx: AtLeastOne = 16
    ctx_std: Positive = 0.02


@register_method("promptfl")
class PromptFL(Method):
    Params = PromptFLParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        placeholders = " ".join(["X"] * self.params.n_ctx)
        model = build_classifier(config, [task.class_names for task in tasks], template=placeholders + " {}.")
        torch.manual_seed(seed)
        add_learnable_context(model, self.params.n_ctx, self.params.ctx_std)
        return model
