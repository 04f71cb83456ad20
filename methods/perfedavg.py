"""Per-FedAvg, first-order: FedAvg of a model meant to be personalized by one gradient step (*Personalized
Federated Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning Approach*, Fallah et al.,
NeurIPS 2020, arXiv 2002.07948).

One of TAP's baselines (docs/tap.md#baselines). TAP's paper gives no details of it and its released code has
none, so this is our reading. Each local optimizer step minimises the MAML objective
``F_i(w) = f_i(w - alpha grad f_i(w))`` to first order: the micro-batch is split into halves H and H'; the
inner step ``w' = w - alpha grad f(w; H)`` is taken and the outer gradient is ``grad f(w'; H')``, applied to w by
the configured optimizer (AdamW in TAP's setting). ``inner_lr`` (alpha) defaults to the configured learning
rate on its schedule (TAP: 1e-4 -> 3e-4 over 20 rounds, the same as the outer one). Clients are evaluated,
after the last round, with the global model adapted by one plain gradient step (alpha) on one local batch;
``local_<metric>@global`` is the global model itself, and with ``post_fl_microbatches`` P > 0 also ``@pt`` and
``@pt2``: the global model post-trained P and 2P micro-batches at ``post_lr`` ("Per-FedAvg + Post-train").

Generic over any model: the engine's default one, or the one ``model.client`` chooses (TAP's: ``mome``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from rayfed.method import (AfterFederationStage, ClientState, LocalResult, Method, TensorDict, post_train_views,
                           stored_views)
from rayfed.methods.tap.options import MOVED_TO_CLIENT_MODEL
from rayfed.models.peft.modules import select_task
from rayfed.params import NonNegativeInt, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import CapturedLoss, ClientContext, Step, scheduled_lr
from rayfed.types import Batch, Slot


@hyperparameters
class PerFedAvgParams:
    inner_lr: Positive | None = None  # alpha; None: the configured lr on its schedule
    post_fl_microbatches: NonNegativeInt = 0  # P of the "+ Post-train" views (0: none)
    post_lr: Positive = 1e-4
    removed_hyperparameters: ClassVar[dict[str, str]] = MOVED_TO_CLIENT_MODEL


def _halves(batch: Batch) -> tuple[Batch, Batch]:
    """The first and second half of a batch's rows (one row: that row twice)."""
    rows = len(next(iter(batch.values())))
    cut = max(rows // 2, 1)
    second = slice(cut, rows) if rows > 1 else slice(0, rows)
    return {k: v[:cut] for k, v in batch.items()}, {k: v[second] for k, v in batch.items()}


def _task_loss(model: nn.Module, params: dict[str, torch.Tensor], parts: Sequence[tuple[Task, Batch]]) -> torch.Tensor:
    """``sum_o lambda_o l_o`` of ``parts`` with ``params`` in place of the model's live values."""
    total = sum(len(next(iter(batch.values()))) for _, batch in parts)
    loss = 0.0
    for task, batch in parts:
        select_task(model, task.index)
        outputs = torch.func.functional_call(model, params, (batch,), strict=False)
        loss = loss + task.kind.loss(outputs, batch) * (len(next(iter(batch.values()))) / total)
    return loss


def inner_step(step: Step, parts: Sequence[tuple[Task, Batch]], alpha: float) -> dict[str, torch.Tensor]:
    """``w - alpha grad f(w; parts)``, the gradient detached (first order): d(result)/dw is the identity."""
    live = dict(step.params)
    grads = torch.autograd.grad(_task_loss(step.model, live, parts), list(live.values()), allow_unused=True)
    return {name: value if grad is None else value - alpha * grad.detach()
            for (name, value), grad in zip(live.items(), grads)}


@register_method("perfedavg")
class PerFedAvg(Method):
    Params = PerFedAvgParams
    stages = (AfterFederationStage(),)

    def _alpha(self, client: ClientContext) -> float:
        if self.params.inner_lr is not None:
            return self.params.inner_lr
        config = client.train_config
        return config.lr if config.schedule == "constant" else scheduled_lr(config, config.lr, client.round, 0)

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        alpha = self._alpha(client)

        def maml_loss(step: Step) -> torch.Tensor:
            halves = [(task, _halves(batch)) for task, batch in step.parts]
            inner, outer = [(task, h) for task, (h, _) in halves], [(task, h) for task, (_, h) in halves]
            return _task_loss(step.model, inner_step(step, inner, alpha), outer)

        start = {**state[Slot.PERSONAL], **(payload or {})}
        # Tensor work on the step alone (its inner step included), fixed by alpha: a CUDA graph may capture it.
        result = client.train(start, loss=CapturedLoss(maml_loss, ("perfedavg", alpha)))
        shared, personal = self.split(result.params)
        return LocalResult({**state, Slot.PERSONAL: personal}, {Slot.SHARED: shared} if shared else {}, result.loss)

    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        global_params = {**state[Slot.PERSONAL], **(payload or {})}
        alpha = self._alpha(client)
        adapted: dict[str, TensorDict] = {}

        def adapt(step: Step) -> torch.Tensor:  # one plain gradient step on one local batch, kept aside
            adapted["params"] = {n: v.detach().clone() for n, v in inner_step(step, step.parts, alpha).items()}
            return _task_loss(step.model, dict(step.params), step.parts)

        client.train(global_params, steps=1, loss=adapt, purpose="personalize")  # the engine's own step is dropped
        state = {**state, "view:adapted": adapted["params"]}
        if self.params.post_fl_microbatches:
            state.update(post_train_views(client, global_params, self.params.post_fl_microbatches,
                                          self.params.post_lr))
        return state

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        global_params = {**state[Slot.PERSONAL], **(payload or {})}
        if "view:adapted" not in state:  # during the rounds: the global model
            return {"": global_params}
        views = stored_views(state)
        return {"": views.pop("adapted"), "global": global_params, **views}

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return self.eval_views(state, payload)[""]
