"""DisentAFL: FedAvg with an orthogonality loss that disentangles the representations of (modality, task)
pairs in a MoTE / MoME model.

One of TAP's baselines (docs/tap.md#baselines; *TAP: Two-Stage Adaptive Personalization of Multi-Task and
Multi-Modal Foundation Models in Federated Learning*, arXiv 2509.26524, App. A.2, and its released code's
``compute_orthogonal_loss``). Local training adds, per micro-batch, ``weight * mean over pairs (i < j) of
mean((norm(a_i) norm(a_j)^T)^2)`` over the groups of latents a_g: the MoTE output of the private
modality-task (MT) path, mean-pooled over tokens, of every (modality, task key) the micro-batch holds. A
micro-batch of a single modality and task has no pairs and no such loss. Aggregation is FedAvg over the blocks
(component-wise, |D_i|-weighted). With ``post_fl_microbatches`` P > 0, ``@pt`` and ``@pt2`` report the model
post-trained P and 2P micro-batches, orthogonality loss included (the code's "DisentAFL + Post-train").

The model is TAP's (``model.client: mome``, docs/tap.md#the-model); any client model works that collects
``((modality, task key), latent)`` pairs in ``collected_latents`` while that attribute is a list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.method import (AfterFederationStage, ClientState, LocalResult, Method, TensorDict, post_train_views,
                           stored_views)
from rayfed.methods.tap.options import MOVED_TO_CLIENT_MODEL
from rayfed.models import Backbone
from rayfed.params import NonNegative, NonNegativeInt, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import CapturedLoss, ClientContext, Step
from rayfed.types import Slot


def orthogonality_loss(latents: Sequence[tuple[tuple[str, str], torch.Tensor]]) -> torch.Tensor | None:
    """The mean over pairs of distinct groups of ``mean((norm(a_i) norm(a_j)^T)^2)``; None with fewer than two
    groups. Latents of one group are concatenated along the batch; groups are taken in sorted order."""
    grouped: dict[tuple[str, str], list[torch.Tensor]] = {}
    for group, latent in latents:
        grouped.setdefault(group, []).append(latent.float())
    groups = [nn.functional.normalize(torch.cat(grouped[g]), dim=1) for g in sorted(grouped)]
    if len(groups) < 2:
        return None
    pairs = [(a @ b.T).pow(2).mean() for i, a in enumerate(groups) for b in groups[i + 1:]]
    return sum(pairs) / len(pairs)


@runtime_checkable
class CollectsLatents(Protocol):
    """A client model that appends ``((modality, task key), latent)`` pairs to ``collected_latents`` while that
    attribute is a list (TAP's model does)."""

    collected_latents: list[tuple[tuple[str, str], torch.Tensor]] | None


@hyperparameters
class DisentAFLParams:
    ortho_weight: NonNegative = 0.5  # Table 21
    post_fl_microbatches: NonNegativeInt = 0  # P of the "+ Post-train" views (0: none)
    post_lr: Positive = 1e-4
    removed_hyperparameters: ClassVar[dict[str, str]] = MOVED_TO_CLIENT_MODEL


@register_method("disentafl")
class DisentAFL(Method):
    Params = DisentAFLParams
    stages = (AfterFederationStage(),)

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        model = super().build_model(backbone, config, tasks, seed)
        if not isinstance(model, CollectsLatents):
            raise ConfigError(f"methods (disentafl) needs a model that collects its modality-task latents, not "
                              f"model.client = {config.client!r}; set model.client: mome (TAP's modular model).")
        return model

    def loss(self, step: Step) -> torch.Tensor:
        """The task loss plus the orthogonality loss of the micro-batch's latents."""
        model = step.model
        model.collected_latents = []
        try:
            loss = step.task_loss(step.part_losses())
            ortho = orthogonality_loss(model.collected_latents)
        finally:
            model.collected_latents = None
        if ortho is None or not self.params.ortho_weight:
            return loss
        return loss + self.params.ortho_weight * ortho

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        # Tensor work on the step alone (the latents' groups follow its task), fixed by the weight: a CUDA graph may
        # capture the step with it.
        loss = CapturedLoss(self.loss, ("disentafl", self.params.ortho_weight))
        result = client.train({**state[Slot.PERSONAL], **(payload or {})}, loss=loss)
        shared, personal = self.split(result.params)
        return LocalResult({**state, Slot.PERSONAL: personal}, {Slot.SHARED: shared} if shared else {}, result.loss)

    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        if not self.params.post_fl_microbatches:
            return state
        start = {**state[Slot.PERSONAL], **(payload or {})}
        return {**state, **post_train_views(client, start, self.params.post_fl_microbatches, self.params.post_lr,
                                            loss=self.loss)}

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        return {"": {**state[Slot.PERSONAL], **(payload or {})}, **stored_views(state)}

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return self.eval_views(state, payload)[""]
