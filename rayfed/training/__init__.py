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

The machinery lives by job, one module each: ``client_context`` (the client, its train calls and their steps),
``optimizers`` (optimizers and learning-rate schedules), ``fast_steps`` (bf16, ``torch.compile`` and CUDA graphs),
``scoring`` (test sets scored batch by batch), ``public_pass`` (the server-side stages on public data), ``batching``
(several clients' steps stacked into one forward) and ``loss_terms`` (the terms methods add to a task loss). This
package re-exports what methods use.
"""

from __future__ import annotations

from rayfed.training.client_context import (
    ClientContext, LossFn, OtherTask, Penalty, Phase, StackedTrainer, Step, TrainResult, stacked_forward_batch,
)
from rayfed.training.fast_steps import MAX_GRAPHS_PER_MODEL, GraphedStep, PatchMatmul, mixed_precision, trained_forward
from rayfed.training.loss_terms import IMAGE_KD, distillation_loss, output_distillation, proximal_penalty
from rayfed.training.optimizers import build_optimizer, local_steps, scheduled_lr
from rayfed.training.public_pass import (
    PreFederation, PublicJob, PublicLoss, PublicPass, answer_mask, same_answers, token_losses,
)

__all__ = ["IMAGE_KD", "MAX_GRAPHS_PER_MODEL", "ClientContext", "GraphedStep", "LossFn", "OtherTask", "PatchMatmul",
           "Penalty", "Phase", "PreFederation", "PublicJob", "PublicLoss", "PublicPass", "StackedTrainer", "Step",
           "TrainResult", "answer_mask", "build_optimizer", "distillation_loss", "local_steps", "mixed_precision",
           "proximal_penalty", "same_answers", "scheduled_lr", "stacked_forward_batch", "token_losses",
           "trained_forward"]
