"""Local training and evaluation of one client, as methods call them from their hooks: what a method imports.

:meth:`ClientContext.train` runs minibatch steps from given parameter values. By default each step
minimises the client's task loss (a client holding several tasks: ``sum_o lambda_o loss_o`` with
``lambda_o`` the task's share of the batch) with one optimizer over every trained parameter. A method
may instead pass

- ``loss``: a function of the :class:`Step` (the batch, the model, its outputs, extra forwards with
  other parameter values such as a frozen teacher's) returning the loss to minimise;
- ``phases``: several optimizer steps per batch, each over its own parameters with its own loss and
  learning rate (e.g. two sequential updates of different parameter sets);
- ``optimizer_state``: the optimizer's state from an earlier call (``TrainResult.optimizer_state``), to
  keep it across rounds;

and ``train.grad_accum`` micro-batches make one optimizer step; ``train.schedule`` may key the learning
rate to the round.

The machinery lives by job, a module of this package each: ``client_context`` (the client and its train calls, each
handed to one step plan), ``plans`` (the step plans: eager, a captured graph of the whole step or of its parts, stacked
with other clients'), ``steps`` (one step as a loss function sees it), ``optimizers`` (optimizers and learning-rate
schedules), ``precision`` (bf16 autocast), ``penalties`` (extra terms a graph may capture), ``compiled_forward`` and
``patch_matmul`` (``torch.compile``), ``graph_capture`` (CUDA graphs), ``lru`` (the plans' caches), ``scoring`` (test
sets scored batch by batch) and ``public_pass`` (the server-side stages on public data). This module holds the loss
terms methods add to a task loss, and re-exports the rest.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from rayfed.training.client_context import ClientContext, OtherTask, TrainResult
from rayfed.training.compiled_forward import trained_forward
from rayfed.training.optimizers import build_optimizer, local_steps, scheduled_lr
from rayfed.training.patch_matmul import PatchMatmul
from rayfed.training.penalties import TensorPenalty
from rayfed.training.precision import check_precision, computes_in_bf16, mixed_precision
from rayfed.training.public_pass import (PreFederation, PublicJob, PublicLoss, PublicPass, answer_mask, same_answers,
                                         token_losses)
from rayfed.training.steps import (CapturedLoss, LossFn, Penalty, Phase, RecordedTaskLoss, Step, StepObserver,
                                   stacked_forward_batch)
from rayfed.types import TensorDict

__all__ = ["CapturedLoss", "ClientContext", "LossFn", "OtherTask", "PatchMatmul", "Penalty", "Phase", "PreFederation",
           "PublicJob", "PublicLoss", "PublicPass", "RecordedTaskLoss", "Step", "StepObserver", "TensorPenalty",
           "TrainResult", "answer_mask", "build_optimizer", "check_precision", "computes_in_bf16", "distillation_loss",
           "local_steps", "mixed_precision", "proximal_penalty", "same_answers", "scheduled_lr",
           "stacked_forward_batch", "token_losses", "trained_forward"]


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``tau^2 KL(softmax(teacher / tau) || softmax(student / tau))`` over the last axis, summed over any
    other axes and averaged over the first (Hinton's knowledge distillation, ``batchmean``); the teacher is
    detached."""
    student, teacher = student.float(), teacher.detach().float()
    log_student = nn.functional.log_softmax(student / temperature, dim=-1)
    log_teacher = nn.functional.log_softmax(teacher / temperature, dim=-1)
    return nn.functional.kl_div(log_student, log_teacher, reduction="batchmean", log_target=True) * temperature**2


ImageKD = Literal["softmax", "mse"]  # how output_distillation compares two images: KL over the width axis, or MSE


def output_distillation(student: torch.Tensor, teacher: torch.Tensor, temperature: float,
                        image_kd: str | None = None) -> torch.Tensor:
    """Knowledge distillation between two decoders' outputs: ``tau^2 KL(p_T || p_S)``, batchmean, over the last
    axis (classes; the vocabulary at every output position, pad included; an image's width axis), or, for images
    compared with ``image_kd = mse``, the mean squared error between them."""
    if image_kd == "mse":
        return nn.functional.mse_loss(student.float(), teacher.float())
    return distillation_loss(student, teacher, temperature)


def proximal_penalty(anchor: TensorDict | None, strength: float) -> TensorPenalty | None:
    """``strength / 2 * ||w - anchor||^2`` over the parameters present in ``anchor`` (tensor work alone: a CUDA
    graph may capture it with the step)."""
    if anchor is None or strength == 0:
        return None
    return TensorPenalty(_proximal_term, {"anchor": anchor}, (strength,))


def _proximal_term(params: dict[str, torch.Tensor], inputs: dict[str, TensorDict], strength: float) -> torch.Tensor:
    return 0.5 * strength * sum(((params[n] - a) ** 2).sum() for n, a in inputs["anchor"].items())
