"""TAP: two-stage adaptive personalization of a multi-modal, multi-task mixture-of-experts model.

*TAP: Two-Stage Adaptive Personalization of Multi-Task and Multi-Modal Foundation Models in Federated Learning*
(arXiv 2509.26524, §3-§4, Algorithm 1, Tables 21-22); docs/tap.md#the-method, docs/tap.md#hyperparameters and
docs/tap.md#deviations-from-the-released-code-and-why. The model is TAP's modular one
(:mod:`rayfed.methods.tap.model`, chosen by ``model.client: mome``): every trainable block is shared and
aggregated component-wise (each tensor over the round's clients that hold it, weighted by |D_i|: the engine's
default aggregation over task-tagged parameters). Each client keeps, next to the FL-engaged model W (the
server's blocks, received every round), a personalized model X of the same architecture over the same frozen
weights, never sent:

- **Stage 1** (every sampled round): W trains locally and is uploaded. For each of the client's tasks o (a task
  key, docs/tap.md#the-model: ``image_classification``, ``image_generation``, ``text_classification``,
  ``text_generation``), if ``h_W[o] + m_o < h_X[o]`` (Eq. 3; the last round's mean training loss of each model
  on o, X's starting at +inf) every block on o's forward path is copied from the locally trained,
  pre-aggregation W into X (Eq. 4).
  Then X trains like W (on other batches after a replacement [C]).
- **Stage 2** (after the last round): W is post-trained P micro-batches ("FedAvg + Post-train", view ``pt``),
  frozen (eval mode) and distils into X, which trains P micro-batches on ``sum_o lambda_o l_o + sum_o beta_o
  tau^2 KL(p_T || p_S)`` (Eqs. 5-6) on the teacher's batches.

X is what TAP is evaluated with (the plain metric names); one run also reports, as ``<metric>@<view>``:
``fedavg`` (the received W), ``pt`` and ``pt2`` (W post-trained P and 2P micro-batches), ``stage1`` (X before
stage 2), ``nokd`` (X post-trained with beta = 0) and ``kdalt`` (X distilled with ``alt_kd_weights``). The KD
weights beta default to Table 21's (``kd_weights: paper``); ``code`` names the authors' code's vector. Per-round
replacement counts go into the round events (``client_stats``: ``replaced/<task>``, ``seen/<task>``). With
``personalize: false`` there is no X (FedAvg alone, the same W trajectory bit for bit); with ``federated:
false`` nothing is communicated either (the Local baseline in the same model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.method import (AfterFederationStage, ClientState, LocalResult, Method, TensorDict, post_fl_steps,
                           post_train_views, stored_views)
from rayfed.methods.tap.model import MoMEModel, task_outputs
from rayfed.methods.tap.options import MOVED_TO_CLIENT_MODEL, TASK_KEYS, task_key
from rayfed.models import Backbone
from rayfed.models.module_walks import functional_forward
from rayfed.models.peft.modules import select_task
from rayfed.params import NonNegativeInt, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import (ClientContext, ImageKD, RecordedTaskLoss, Step, TrainResult, output_distillation,
                              scheduled_lr)
from rayfed.state_tree import map_tree, tree_leaves
from rayfed.types import host_copies

# Per task key, in the order of TASK_KEYS: image-cls, image-gen, text-cls, text-gen.
PAPER_MARGINS_FLAVA = (0.01, 0.005, 0.005, 0.01)  # Table 22
PAPER_KD_WEIGHTS = (2e-3, 2e-3, 2e-3, 1.0)  # Table 21 as extracted: text generation 1
CODE_KD_WEIGHTS = (2e-3, 2e-3, 1.0, 2e-3)  # the authors' code: 2e-3, text classification x 500
KD_WEIGHT_PRESETS = {"paper": PAPER_KD_WEIGHTS, "code": CODE_KD_WEIGHTS}


def _per_key(values: Sequence[float], name: str) -> None:
    if len(values) != len(TASK_KEYS):
        raise ValueError(f"{name} needs {len(TASK_KEYS)} values, one per task key ({', '.join(TASK_KEYS)})")
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError(f"{name} must be >= 0")


def kd_weight_vector(weights: str | Sequence[float], name: str = "kd_weights") -> tuple[float, ...]:
    """beta_o per task key: a preset's (``paper``: Table 21, ``code``: the authors' code) or the given values."""
    if isinstance(weights, str):
        if weights not in KD_WEIGHT_PRESETS:
            raise ValueError(f"{name} must be {' or '.join(KD_WEIGHT_PRESETS)} (Table 21's or the authors' code's "
                             f"vector) or {len(TASK_KEYS)} numbers >= 0, one per task key ({', '.join(TASK_KEYS)})")
        return KD_WEIGHT_PRESETS[weights]
    _per_key(weights, name)
    return tuple(weights)


@hyperparameters
class TAPParams:
    margins: tuple[float, ...] = PAPER_MARGINS_FLAVA  # m_o per task key (image-cls, image-gen, text-cls, text-gen)
    kd_weights: str | tuple[float, ...] = "paper"  # beta_o per task key, or a preset of KD_WEIGHT_PRESETS
    alt_kd_weights: str | tuple[float, ...] | None = None  # a second distilled X (view kdalt), e.g. "code"
    kd_temperature: Positive = 1.0  # tau
    image_kd: ImageKD = "softmax"  # image generation's KD: softmax over the width axis (code) or mse
    # a task's loss history: lambda-weighted mean over micro-batches (code) or plain
    history: Literal["weighted", "plain"] = "weighted"
    post_fl_microbatches: NonNegativeInt = 50  # P, in micro-batches (train.grad_accum of them make one optimizer step)
    post_lr: Positive = 1e-4
    two_p: bool = True  # also W post-trained 2P micro-batches (view pt2)
    no_kd: bool = True  # also X post-trained without distillation (view nokd)
    swap_batches: bool = True  # after a replacement, X trains on other batches than W this round [C]
    personalize: bool = True  # False: no X, FedAvg alone
    federated: bool = True  # False: nothing is communicated (Local)
    removed_hyperparameters: ClassVar[dict[str, str]] = MOVED_TO_CLIENT_MODEL

    def __post_init__(self) -> None:  # vectors of one value per task key (TASK_KEYS)
        _per_key(self.margins, "margins")
        kd_weight_vector(self.kd_weights, "kd_weights")
        if self.alt_kd_weights is not None:
            kd_weight_vector(self.alt_kd_weights, "alt_kd_weights")

    def margin(self, key: str) -> float:
        return self.margins[TASK_KEYS.index(key)]


def client_groups(tasks: Sequence[Task], held: Sequence[int]) -> dict[str, list[int]]:
    """TAP's tasks of a client: its run tasks grouped by task key (e.g. three MMLU subjects: one task)."""
    groups: dict[str, list[int]] = {}
    for index in held:
        groups.setdefault(task_key(tasks[index]), []).append(index)
    return groups


class LossHistory(RecordedTaskLoss):
    """A training loss function (the default task loss) that also records each TAP task's loss over the call:
    ``weighted``: (1 / #micro-batches) sum_mb lambda_o,mb l_o,mb (the code's), ``plain``: the mean over the
    micro-batches holding o of o's own loss. A captured step may run it (``train.cuda_graphs``)."""

    def __init__(self, groups: dict[str, list[int]], mode: str):
        self.key_of = {index: key for key, indices in groups.items() for index in indices}
        self.mode = mode
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self.microbatches = 0

    def record(self, step: Step, losses: Sequence[torch.Tensor]) -> None:
        rows = {id(batch): len(next(iter(batch.values()))) for _, batch in step.parts}
        total = sum(rows.values())
        by_key: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for (task, batch), loss in zip(step.parts, losses):
            by_key.setdefault(self.key_of[task.index], []).append((rows[id(batch)], loss.detach().float()))
        for key, items in by_key.items():
            if self.mode == "weighted":
                value = sum(loss * (count / total) for count, loss in items)
            else:
                value = sum(loss * count for count, loss in items) / sum(count for count, _ in items)
            self.sums[key] = self.sums[key] + value if key in self.sums else value
            self.counts[key] = self.counts.get(key, 0) + 1
        self.microbatches += 1

    def values(self) -> dict[str, torch.Tensor]:
        """Each key's loss over the call, left on the device (read only where a decision needs it)."""
        divisor = (lambda key: self.microbatches) if self.mode == "weighted" else self.counts.__getitem__
        return {key: total / divisor(key) for key, total in self.sums.items()}


class Distillation:
    """The post-FL student loss (Eq. 6): ``sum_o lambda_o l_o + sum_o beta_o tau^2 KL(p_T || p_S)`` with the
    teacher frozen in eval mode (it draws no dropout); a task whose beta is 0 skips the teacher, so beta = 0
    everywhere is exactly the task loss. ``targets``: the teacher's outputs by (call, part), shared by the
    distillations of one teacher on the same batches, which then run its forward once; without it, a call's
    outputs are dropped at the next call (no other distillation reads them)."""

    def __init__(self, teacher: TensorDict | None, weights: Sequence[float], temperature: float, image_kd: str,
                 targets: dict[tuple[int, int], torch.Tensor] | None = None):
        self.teacher, self.weights, self.temperature, self.image_kd = teacher, weights, temperature, image_kd
        self.shared = targets is not None
        self.targets = {} if targets is None else targets
        self.calls = 0

    def __call__(self, step: Step) -> torch.Tensor:
        model = step.model
        targets = self._targets(step)  # before the student's forwards: the teacher draws no random numbers
        losses, distilled = [], []
        for part, (task, batch) in enumerate(step.parts):
            raw, outputs = task_outputs(model, task, batch)
            losses.append(task.kind.loss(outputs, batch))
            if part in targets:
                distilled.append(self.weights[TASK_KEYS.index(task_key(task))] * self.term(task_key(task), raw,
                                                                                              targets[part]))
        self.calls += 1
        loss = step.task_loss(losses)
        return loss + sum(distilled) if distilled else loss

    def _targets(self, step: Step) -> dict[int, torch.Tensor]:
        """The teacher's outputs on each part whose task key has a KD weight, by part."""
        if self.teacher is None:
            return {}
        parts = [part for part, (task, _) in enumerate(step.parts) if self.weights[TASK_KEYS.index(task_key(task))]]
        if not self.shared:
            self.targets.clear()
        missing = [part for part in parts if (self.calls, part) not in self.targets]
        if missing:
            model = step.model
            model.eval()
            with torch.no_grad():
                for part in missing:
                    task, batch = step.parts[part]
                    select_task(model, task.index)
                    self.targets[self.calls, part] = functional_forward(model, self.teacher, batch, raw=True)
            model.train()
        return {part: self.targets[self.calls, part] for part in parts}

    def term(self, key: str, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """Eq. 5 for a task with key ``key``: ``tau^2 KL(p_T || p_S)``, or as ``image_kd`` says for generated images."""
        images = self.image_kd if key == "image_generation" else None
        return output_distillation(student, teacher, self.temperature, images)


@register_method("tap")
class TAP(Method):
    Params = TAPParams
    stages = (AfterFederationStage(),)

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        model = super().build_model(backbone, config, tasks, seed)
        if not isinstance(model, MoMEModel):
            raise ConfigError(f"methods (tap) trains TAP's modular model, not model.client = {config.client!r}; set "
                              "model.client: mome, its options under model.client_options.")
        return model

    def is_shared(self, name: str) -> bool:
        return self.params.federated

    # Client side ---------------------------------------------------------------------------------------
    def init_client(self, initial: TensorDict) -> ClientState:
        state: ClientState = {"personal": {} if self.params.federated else dict(initial), "history": {}}
        if self.params.personalize:
            state["x"] = dict(initial)  # X starts from the same-seed initialization as W
        return state

    def _w(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return dict(payload or {}) if self.params.federated else state["personal"]

    def _train(self, client: ClientContext, params: TensorDict, groups: dict[str, list[int]], **kwargs: Any,
               ) -> tuple[TrainResult, dict[str, torch.Tensor]]:
        history = LossHistory(groups, self.params.history)
        result = client.train(params, loss=history, **kwargs)
        return result, history.values()

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        groups = client_groups(self.tasks, client.data.tasks)
        trained, w_losses = self._train(client, self._w(state, payload), groups)
        previous = state["history"]  # each model's latest loss by task key: {"w": {key: loss}, "x": {key: loss}}
        history = {"w": {**previous.get("w", {}), **{key: value.to(torch.float64) for key, value in w_losses.items()}},
                   "x": dict(previous.get("x", {}))}
        new_state = {**state, "history": history}
        upload = {"shared": trained.params} if self.params.federated else {}
        if not self.params.federated:
            new_state["personal"] = trained.params
        if not self.params.personalize:
            return LocalResult(new_state, upload, trained.loss)

        x = dict(state["x"])
        losses = _read(history)  # W's losses and X's previous ones, read from the device together (one wait)
        replaced = [key for key in w_losses
                    if losses["w"][key] + self.params.margin(key) < losses["x"].get(key, math.inf)]
        model = client.model
        assert isinstance(model, MoMEModel), "TAP trains rayfed.methods.tap.MoMEModel"
        for key in replaced:  # Eq. 4: a hard copy of o's path from the locally trained, pre-aggregation W
            x.update({name: value for name, value in trained.params.items() if model.on_path(name, groups[key])})
        if replaced and self.params.swap_batches:
            config = client.train_config
            lr = config.lr if config.schedule == "constant" else scheduled_lr(config, config.lr, client.round, 0)
            x_trained, x_losses = self._train(client, x, groups, purpose="personal:swapped", lr=lr)
        else:  # the batches, dropout and learning rate of W's update
            x_trained, x_losses = self._train(client, x, groups)
        history["x"].update({key: value.to(torch.float64) for key, value in x_losses.items()})
        new_state["x"] = x_trained.params
        stats = {}
        for key, indices in groups.items():
            for index in indices:
                stats[f"seen/{self.tasks[index].name}"] = 1.0
                stats[f"replaced/{self.tasks[index].name}"] = float(key in replaced)
        return LocalResult(new_state, upload, trained.loss, stats=stats)

    # Stage 2 -------------------------------------------------------------------------------------------
    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        microbatches = self.params.post_fl_microbatches
        if not self.params.federated or not microbatches:
            return state
        steps = post_fl_steps(microbatches, client.train_config.grad_accum)

        def post_train(params: TensorDict, count: int, loss: Any = None) -> TensorDict:
            # Every post-FL model sees the same batches in the same order (purpose post_train).
            return client.train(params, steps=count, lr=self.params.post_lr, purpose="post_train", loss=loss).params

        state = {**state, **post_train_views(client, self._w(state, payload), microbatches, self.params.post_lr,
                                             (1, 2) if self.params.two_p else (1,))}
        teacher = state["view:pt"]
        if not self.params.personalize:
            return state
        x = state["x"]
        state["view:stage1"] = x
        if self.params.no_kd:
            state["view:nokd"] = post_train(x, steps, self.distillation(None))
        targets = None  # kept for a second distillation on the same batches: the teacher's outputs once
        if self.params.alt_kd_weights is not None:
            targets = {}
            state["view:kdalt"] = post_train(x, steps, self.distillation(teacher, self.params.alt_kd_weights, targets))
        state["x"] = post_train(x, steps, self.distillation(teacher, targets=targets))
        return state

    def distillation(self, teacher: TensorDict | None, weights: str | Sequence[float] | None = None,
                     targets: dict[tuple[int, int], torch.Tensor] | None = None) -> Distillation:
        """Stage 2's student loss with ``teacher`` (None: no KD) and KD weights ``weights`` (default ``kd_weights``),
        sharing the teacher's outputs ``targets`` with other distillations on the same batches."""
        p = self.params
        return Distillation(teacher, kd_weight_vector(p.kd_weights if weights is None else weights), p.kd_temperature,
                            p.image_kd, targets)

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        w = self._w(state, payload)
        views = {"": state["x"], "fedavg": w} if self.params.personalize else {"": w}
        return {**views, **stored_views(state)}

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return self.eval_views(state, payload)[""]


def _read(values: dict[str, Any]) -> dict[str, Any]:
    """A tree of 0-d tensors' values, read together (one wait for the device)."""
    on_host = host_copies(value for _, value in tree_leaves(values))
    return map_tree(values, lambda value: float(on_host[id(value)]))
