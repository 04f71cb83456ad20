"""FedDAT-style dual-adapter teacher with LoRA adapters, on any backbone with decoder layers (LLaVA, Llama, Qwen).

FedDAT (Chen et al., AAAI 2024, arXiv 2308.12305) as FedMosaic's paper, *Not All Clients Are Equal: Collaborative Model
Personalization on Heterogeneous Multi-Modal Clients*, runs it as a baseline (docs/fedmosaic.md#ablations-baselines; the
paper gives no details, this is our reading), with its adapters as conventional LoRA on every linear layer
(:mod:`rayfed.models.peft.named_adapters`) instead of bottleneck adapters (:mod:`rayfed.methods.feddat`, which targets
ViLT-style encoders).
Three adapters per layer: ``shared`` (trained, uploaded, averaged within an architecture), ``frozen`` (the shared
adapter received this round) and ``local`` (kept). Each batch takes two steps: ``CE(z_s) + kd KD(z_s, z_DAT)`` on the
shared adapter, then ``CE(z_DAT) + kd KD(z_DAT, z_s)`` on the local one, with the dual-adapter teacher ``z_DAT`` from
``W x + (B_f A_f x + B_l A_l x) / 2``; KD = tau^2 KL at tau = 3, its weight ramped up as ``kd exp(-5 (1 - t / t_r)^2)``
over the first quarter of the rounds. Clients are evaluated with the shared adapter (FedDAT's own choice); ``@dat``
reports the teacher.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.method import ClientState, LocalResult, Method, TensorDict
from rayfed.models import Backbone, build_lora_set
from rayfed.models.peft import named_adapters
from rayfed.param_names import adapter_of, with_adapter
from rayfed.params import NonNegative, Positive, hyperparameters
from rayfed.registry import register_method
from rayfed.tasks import Task
from rayfed.training import ClientContext, Phase, Step, distillation_loss
from rayfed.types import Slot

SHARED, FROZEN, LOCAL = "shared", "frozen", "local"
STUDENT = {SHARED: 1.0}
TEACHER = {FROZEN: 0.5, LOCAL: 0.5}


@hyperparameters
class FedDATLoraParams:
    tau: Positive = 3.0
    kd_weight: NonNegative = 1.0  # the maximum of both KD weights
    rampup: bool = True


def _answer_logits(batch: dict[str, torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    """The logits at the positions a text task's loss reads (those predicting a target token); else all of them."""
    labels = batch.get("labels")
    if labels is None or labels.dim() != 2:
        return logits
    return logits[:, :-1][labels[:, 1:] != -100]


def _mutual_loss(step: Step, trained: dict, other: dict, kd: float, tau: float, keep: str | None = None,
                 teacher_key: str | None = None) -> torch.Tensor:
    """Over the batch's task parts: CE of the model under mix ``trained`` plus ``kd`` times KD towards the model
    under mix ``other`` (or the logits stored as ``teacher_key`` by an earlier phase), each part weighted by its
    share; stores the trained logits as ``keep``."""
    losses = []
    for part, (task, batch) in enumerate(step.parts):
        named_adapters.set_mix(step.model, trained)
        logits = step.outputs(part)
        student = _answer_logits(batch, logits)
        if keep:
            step.memory[f"{keep}:{part}"] = student.detach()
        if teacher_key:
            teacher = step.memory[f"{teacher_key}:{part}"]
        else:
            named_adapters.set_mix(step.model, other)
            with torch.no_grad():
                teacher = _answer_logits(batch, step.outputs(part))
        losses.append(task.kind.loss(logits, batch) + kd * distillation_loss(student, teacher, tau))
    return step.task_loss(losses)


@register_method("feddat_lora")
class FedDATLora(Method):
    Params = FedDATLoraParams

    def build_model(self, backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int) -> nn.Module:
        return build_lora_set(backbone, config, tasks, seed, (SHARED, FROZEN, LOCAL), frozen=(FROZEN,),
                              stream="feddat_lora", owner="methods (feddat_lora)")

    def is_shared(self, name: str) -> bool:
        return adapter_of(name) == SHARED

    def _frozen_copy(self, received: TensorDict) -> TensorDict:
        return {with_adapter(n, FROZEN): v for n, v in received.items() if self.is_shared(n)}

    def local_update(self, client: ClientContext, state: ClientState, payload: TensorDict | None) -> LocalResult:
        received = payload or {}
        ramp = max(1, math.ceil(self.rounds / 4))
        kd = self.params.kd_weight * (math.exp(-5.0 * (1.0 - min(client.round + 1, ramp) / ramp) ** 2)
                                      if self.params.rampup else 1.0)
        tau = self.params.tau

        def student(step: Step) -> torch.Tensor:
            return _mutual_loss(step, STUDENT, TEACHER, kd, tau, keep="z_s")

        def teacher(step: Step) -> torch.Tensor:
            return _mutual_loss(step, TEACHER, STUDENT, kd, tau, teacher_key="z_s")

        params = {**state[Slot.PERSONAL], **received, **self._frozen_copy(received)}
        result = client.train(params, phases=[Phase(trains=self.is_shared, loss=student),
                                              Phase(trains=lambda n: adapter_of(n) == LOCAL, loss=teacher)])
        named_adapters.set_mix(client.model, None)
        shared = {n: v for n, v in result.params.items() if self.is_shared(n)}
        personal = {n: v for n, v in result.params.items() if adapter_of(n) == LOCAL}
        return LocalResult({**state, Slot.PERSONAL: personal}, {Slot.SHARED: shared}, result.loss)

    def eval_views(self, state: ClientState, payload: TensorDict | None) -> dict[str, TensorDict]:
        own = {**state[Slot.PERSONAL], **(payload or {}), **self._frozen_copy(payload or {})}
        return {"": own, "dat": own}

    def eval_params(self, state: ClientState, payload: TensorDict | None) -> TensorDict:
        return self.eval_views(state, payload)[""]

    def activate_view(self, model: nn.Module, view: str) -> None:
        named_adapters.set_mix(model, TEACHER if view == "dat" else STUDENT)
