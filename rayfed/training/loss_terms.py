"""The loss terms methods add to a task loss: knowledge distillation between two models' outputs, and a proximal
penalty toward anchor values."""

from __future__ import annotations

import torch
from torch import nn

from rayfed.training.client_context import Penalty
from rayfed.types import TensorDict


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``tau^2 KL(softmax(teacher / tau) || softmax(student / tau))`` over the last axis, summed over any
    other axes and averaged over the first (Hinton's knowledge distillation, ``batchmean``); the teacher is
    detached."""
    student, teacher = student.float(), teacher.detach().float()
    log_student = nn.functional.log_softmax(student / temperature, dim=-1)
    log_teacher = nn.functional.log_softmax(teacher / temperature, dim=-1)
    return nn.functional.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * temperature**2


IMAGE_KD = ("softmax", "mse")  # how output_distillation compares two images: KL over the width axis, or MSE


def output_distillation(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
                        image_kd: str | None = None) -> torch.Tensor:
    """Knowledge distillation between two decoders' outputs: ``tau^2 KL(p_T || p_S)``, batchmean, over the last
    axis (classes; the vocabulary at every output position, pad included; an image's width axis), or, for images
    compared with ``image_kd = mse``, the mean squared error between them."""
    if image_kd == "mse":
        return nn.functional.mse_loss(student.float(), teacher.float())
    return distillation_loss(student, teacher, temperature)


def proximal_penalty(anchor: TensorDict | None, strength: float) -> Penalty | None:
    """``strength / 2 * ||w - anchor||^2`` over the parameters present in ``anchor``."""
    if anchor is None or strength == 0:
        return None

    anchor_on_device: TensorDict = {}

    def penalty(params: dict[str, torch.Tensor]) -> torch.Tensor:
        if not anchor_on_device:  # payloads arrive on the CPU; move them once, not every step
            anchor_on_device.update({n: a.to(params[n].device) for n, a in anchor.items()})
        return 0.5 * strength * sum(((params[n] - a) ** 2).sum() for n, a in anchor_on_device.items())

    return penalty
