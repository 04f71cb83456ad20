"""FedDAT: a dual-adapter teacher and mutual knowledge distillation for multi-modal foundation models.

*FedDAT: An Approach for Foundation Model Finetuning in Multi-Modal Heterogeneous Federated Learning* (Chen et al.,
AAAI'24, arXiv 2308.12305); docs/feddat.md#the-method. At every adapter site a client holds three adapters:
``shared`` (A_s: trained, uploaded), ``frozen`` (Â_s: the A_s received this round, not trainable, reloaded before
every update and evaluation) and ``local`` (A_c: persists in the client's state, never sent). The dual-adapter
teacher (DAT) is ``h + ½ Â_s(h) + ½ A_c(h)``. Each batch takes two sequential steps (Algorithm 1):
``L^s = CE(z_s) + α KD(z_s, z_DAT)`` on A_s and the head, then ``L^DAT = CE(z_DAT) + β KD(z_DAT, z_s)`` on A_c
and the head, the teachers detached and z_s from before the A_s step; KD = τ² KL(teacher ‖ student) at τ = 3. α
and β follow the exponential ramp-up ``λ exp(-5 (1 - min(t, t_r) / t_r)²)`` over rounds t = 1..t_r
(t_r = ⌈R/4⌉), each objective times ½ (``kd_schedule: constant`` is the authors' code). The server takes the
uniform mean of A_s; heads and A_c never leave the client. Clients are evaluated with A_s and their head;
``local_acc@dat`` and ``local_acc@local`` report the DAT and A_c views (Table 4).

``variant`` gives the ablations of Table 4 (docs/feddat.md#variants-and-baselines): ``no_frozen`` (teacher = A_c
alone, MKD kept), ``no_local`` (teacher = Â_s, no L^DAT), ``no_mkd`` (DAT → A_s only, A_c trained with CE: β = 0),
and ``peft``: the paper's baselines, the config's ``model.module`` alone (adapter, lora, prompt, bias, full, head)
trained with CE, with the same local heads and uniform mean; ``federated: false`` keeps everything local (clf-L,
Adapter-L, full-L).

The three adapters sit wherever the client model places adapter sets (:class:`rayfed.models.AdapterSets`): the
default model at ``model.adapter``'s sites (``model.module: adapter``), and TAP's modular model (``model.client:
mome``, docs/tap.md#the-model) after every expert's FFN (``backbone_module: adapter``: no LoRA in the MoTE / MoME
backbone; ``Linear D -> b, ReLU, Linear b -> D``, residual, b = ``model.client_options.adapter_dim``). The latter
is TAP's baseline (docs/tap.md#baselines), with ``uploads: all_but_local`` (the FL-engaged model is every
trainable block but A_c: A_s, heads, encoders' LoRA and projections, ``shared_proj``), averaged component-wise like
TAP's FedAvg (with ``aggregation: samples``). A client holding
several tasks takes each objective as ``sum_o lambda_o (CE_o + w KD_o)``; KD compares the outputs the model's
decoders produce themselves (:meth:`rayfed.models.TrainableModule.raw_and_scored`: class logits, the text
decoder's logits at every position, an image's width axis, or with ``image_kd: mse`` the two images' squared
error). ``evaluate: dat`` reports the DAT under the plain metric names (TAP's FedDAT row) and A_s as ``@shared``.

``post_fl_microbatches`` P > 0 adds the "+ Post-train" views ``@pt`` and ``@pt2``: P and 2P more micro-batches of
FedDAT's own two-step training at ``post_lr`` from the last round's model (Â_s the last global A_s), evaluated
as the plain view.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, Literal

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.method import (AfterFederationStage, ClientState, LocalResult, Method, TensorDict, post_train_views,
                           stored_views)
from rayfed.models import AdapterSets, Backbone, client_model
from rayfed.models.peft.modules import set_adapter_mix
from rayfed.param_names import adapter_set_of, components, with_adapter_set
from rayfed.params import AtLeastOne, NonNegative, NonNegativeInt, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import CapturedLoss, ClientContext, ImageKD, Phase, Step, output_distillation
from rayfed.types import Slot

SHARED, FROZEN, LOCAL = "shared", "frozen", "local"
Variant = Literal["feddat", "no_frozen", "no_local", "no_mkd", "peft"]
# The adapters each variant holds per site, and its teacher / DAT mixture.
ADAPTERS = {"feddat": ("shared", "frozen", "local"), "no_mkd": ("shared", "frozen", "local"),
            "no_frozen": ("shared", "local"), "no_local": ("shared", "frozen"), "peft": ()}
DAT = {"feddat": {"frozen": 0.5, "local": 0.5}, "no_mkd": {"frozen": 0.5, "local": 0.5},
       "no_frozen": {"local": 1.0}, "no_local": {"frozen": 1.0}}
STUDENT = {"shared": 1.0}
# The adapter views each variant reports: A_s alone, the DAT, A_c alone (the evaluated one under the plain names).
VIEWS = {"feddat": ("shared", "local", "dat"), "no_mkd": ("shared", "local", "dat"), "no_frozen": ("shared", "local"),
         "no_local": ("shared",), "peft": ("shared",)}
Evaluated = Literal["shared", "dat"]
Uploads = Literal["shared_adapters", "all_but_local"]


@hyperparameters
class FedDATParams:
    tau: Positive = 3.0  # KD temperature, with tau^2 scaling
    alpha: NonNegative = 1.0  # max of the KD weight of L^s (DAT -> A_s)
    beta: NonNegative = 1.0  # max of the KD weight of L^DAT (A_s -> DAT)
    kd_schedule: Literal["exp_rampup", "constant"] = "exp_rampup"
    rampup_rounds: AtLeastOne | None = None  # t_r; default ceil(rounds / 4)
    objective_scale: Positive = 0.5  # each objective's factor (the code's (CE + KD) / 2)
    # two steps per batch; joint: one step on the sum (an option of ours)
    update: Literal["sequential", "joint"] = "sequential"
    variant: Variant = "feddat"
    federated: bool = True
    aggregation: Literal["uniform", "samples"] = "uniform"  # uniform mean (Algorithm 1) or samples (Eq. 3)
    evaluate: Evaluated = "shared"  # the view under the plain metric names: shared (A_s, the paper's) or dat (TAP's)
    post_fl_microbatches: NonNegativeInt = 0  # P of the "+ Post-train" views pt and pt2 (0: none)
    post_lr: Positive = 1e-4
    image_kd: ImageKD = "softmax"  # image reconstruction's KD: softmax over the width axis (TAP's) or mse
    # what a client sends: A_s (heads and A_c stay local) or every trained tensor but A_c (TAP's FedDAT row)
    uploads: Uploads = "shared_adapters"
    removed_hyperparameters: ClassVar[dict[str, str]] = {
        "mome": "set model.client: mome with these options under model.client_options, and uploads: all_but_local "
                "for TAP's FedDAT row"
    }

    def __post_init__(self) -> None:
        if self.evaluate not in VIEWS[self.variant]:
            raise ValueError(f"evaluate = {self.evaluate} needs a variant with a dual-adapter teacher (feddat, "
                             f"no_mkd), not {self.variant}")


@register_method("feddat")
class FedDAT(Method):
    Params = FedDATParams
    stages = (AfterFederationStage(),)

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        variant = self.params.variant
        if variant == "peft":
            return super().build_model(backbone, config, tasks, seed)
        return client_model(backbone, config, tasks, seed, AdapterSets(ADAPTERS[variant], ("frozen",), "feddat"))

    def is_shared(self, name: str) -> bool:
        if not self.params.federated:
            return False
        if self.params.variant == "peft":
            return components(name)[0] != "head"
        if self.params.uploads == "all_but_local":  # Â_s is never trained, so never sent
            return adapter_set_of(name) != LOCAL
        return adapter_set_of(name) == SHARED

    # Client side ---------------------------------------------------------------------------------------
    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        start = {**state[Slot.PERSONAL], **(payload or {})}
        if self.params.variant == "peft":
            result = client.train(start)
        else:
            client.model.load_trainable(self._frozen_copy(start))  # Â_s <- the A_s received this round
            result = client.train(start, phases=self._phases(client.round))
            set_adapter_mix(client.model, None)
        shared, personal = self.split(result.params)
        weight = 1.0 if self.params.aggregation == "uniform" else None
        upload = {Slot.SHARED: shared} if shared else {}
        return LocalResult({**state, Slot.PERSONAL: personal}, upload, result.loss, weight)

    def _frozen_copy(self, start: TensorDict) -> TensorDict:
        """Â_s: the A_s a client starts from (the received one; its own when nothing is communicated)."""
        if "frozen" not in ADAPTERS[self.params.variant]:
            return {}
        return {with_adapter_set(name, FROZEN): value for name, value in start.items()
                if adapter_set_of(name) == SHARED}

    def kd_weight(self, maximum: float, round_idx: int) -> float:
        """α or β in round ``round_idx`` (0-based): ``maximum``, ramped up over the first t_r rounds."""
        if self.params.kd_schedule == "constant":
            return maximum
        ramp = self.params.rampup_rounds or max(1, math.ceil(self.rounds / 4))
        return maximum * math.exp(-5.0 * (1.0 - min(round_idx + 1, ramp) / ramp) ** 2)

    def _phases(self, round_idx: int) -> list[Phase]:
        variant, scale, tau = self.params.variant, self.params.objective_scale, self.params.tau
        alpha = self.kd_weight(self.params.alpha, round_idx)
        beta = 0.0 if variant == "no_mkd" else self.kd_weight(self.params.beta, round_idx)
        dat = DAT[variant]

        # Each objective over the batch's task parts: sum_o lambda_o (CE_o + weight KD_o).
        def student(step: Step) -> torch.Tensor:
            losses = []
            for part, (task, batch) in enumerate(step.parts):
                set_adapter_mix(step.model, STUDENT)
                z_s, scored = self._outputs(step, part)
                step.memory[f"z_s:{part}"] = z_s.detach()
                loss = task.kind.loss(scored, batch)
                if alpha:
                    set_adapter_mix(step.model, dat)
                    with torch.no_grad():
                        z_dat, _ = self._outputs(step, part)
                    loss = loss + alpha * self._kd(task, z_s, z_dat, tau)
                losses.append(loss)
            return scale * step.task_loss(losses)

        def teacher(step: Step) -> torch.Tensor:
            set_adapter_mix(step.model, dat)
            losses = []
            for part, (task, batch) in enumerate(step.parts):
                z_dat, scored = self._outputs(step, part)
                loss = task.kind.loss(scored, batch)
                if beta:
                    loss = loss + beta * self._kd(task, z_dat, step.memory[f"z_s:{part}"], tau)
                losses.append(loss)
            return scale * step.task_loss(losses)

        # Tensor work on the step alone, fixed by these settings: a CUDA graph may capture the step with them.
        settings = (variant, scale, tau, alpha, beta, self.params.image_kd)
        captured_student = CapturedLoss(student, ("feddat student", *settings))
        if variant == "no_local":  # no L^DAT: the only teacher is frozen
            return [Phase(trains=lambda name: adapter_set_of(name) != LOCAL, loss=captured_student)]
        if self.params.update == "joint":
            return [Phase(loss=CapturedLoss(lambda step: student(step) + teacher(step), ("feddat joint", *settings)))]
        return [Phase(trains=lambda name: adapter_set_of(name) != LOCAL, loss=captured_student),
                Phase(trains=lambda name: adapter_set_of(name) != SHARED,
                      loss=CapturedLoss(teacher, ("feddat teacher", *settings)))]

    def _outputs(self, step: Step, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What distillation compares and what the task's kind scores, on ``step.parts[part]``."""
        return step.raw_and_scored(part)

    def _kd(self, task: Task, student: torch.Tensor, teacher: torch.Tensor, tau: float) -> torch.Tensor:
        images = self.params.image_kd if task.kind.name == "reconstruction" else None
        return output_distillation(student, teacher, tau, images)

    def after_federation(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> ClientState:
        microbatches = self.params.post_fl_microbatches
        if not microbatches:
            return state
        start = {**state[Slot.PERSONAL], **(payload or {})}
        if self.params.variant == "peft":
            return {**state, **post_train_views(client, start, microbatches, self.params.post_lr)}
        client.model.load_trainable(self._frozen_copy(start))
        views = post_train_views(client, start, microbatches, self.params.post_lr, phases=self._phases(client.round))
        set_adapter_mix(client.model, None)
        return {**state, **views}

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        own = {**state[Slot.PERSONAL], **(payload or {})}
        frozen = self._frozen_copy(own)
        own.update(frozen)
        views = {view: own for view in self._view_mixtures()}
        # Post-trained views keep the last received A_s as Â_s.
        views.update({view: {**values, **frozen} for view, values in stored_views(state).items()})
        return views

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return self.eval_views(state, payload)[""]

    def _view_mixtures(self) -> dict[str, str]:
        """Each adapter view's name -> the adapters it evaluates (``shared``, ``dat``, ``local``)."""
        evaluated = self.params.evaluate
        return {"": evaluated, **{name: name for name in VIEWS[self.params.variant] if name != evaluated}}

    def activate_view(self, model: nn.Module, view: str) -> None:
        if self.params.variant == "peft":
            return
        adapters = self._view_mixtures().get(view, self.params.evaluate)  # pt, pt2: the evaluated adapters
        set_adapter_mix(model, {"shared": None, "dat": DAT[self.params.variant], "local": {"local": 1.0}}[adapters])
