"""How a train call's steps run: one step plan per call, chosen once by :func:`choose_plan` from the call, the client's
config and device (:class:`~rayfed.training.plans.call.StepPlan`; a module each):

- ``stacked``: a plain update trained in one forward and backward with other clients' (``train.batch_clients``);
- ``graphed_step``: the whole step replayed as a captured CUDA graph (``train.cuda_graphs``, one task, one
  micro-batch a step, a fresh optimizer);
- ``graphed_parts``: the forward and backward of each part of a step replayed as captured graphs, the optimizer
  stepped eagerly (``train.cuda_graphs``, one phase of the task loss: several tasks, ``train.grad_accum``, a kept
  optimizer state or learning rates of the phase's own);
- ``eager``: everything else, and what a plan falls back to when its step cannot be captured or stacked.

The plans of a model (:class:`StepPlans`) are kept with it; each owns what it keeps across calls (its graphs, its
compiled steps) in a :class:`~rayfed.training.lru.LeastRecentlyUsed`. Method authors see none of this: a loss function
sees its :class:`~rayfed.training.steps.Step`, whichever plan runs it.
"""

from __future__ import annotations

from rayfed.models.client import TrainableModule
from rayfed.training.plans.call import StepPlan, TrainCall, TrainResult
from rayfed.training.plans.eager import EagerPlan
from rayfed.training.plans.graphed_parts import GraphedPartsPlan, captures_parts
from rayfed.training.plans.graphed_step import GraphedStepPlan, captures_step
from rayfed.training.plans.stacked import Lockstep, StackedClient, StackedPlan

__all__ = ["EagerPlan", "GraphedPartsPlan", "GraphedStepPlan", "Lockstep", "StackedClient", "StackedPlan", "StepPlan",
           "StepPlans", "TrainCall", "TrainResult", "choose_plan", "step_plans"]


class StepPlans:
    """A model's step plans, one of each kind, kept in its attachments."""

    def __init__(self) -> None:
        self.eager = EagerPlan()
        self.graphed_step = GraphedStepPlan()
        self.graphed_parts = GraphedPartsPlan()
        self.stacked = StackedPlan(self.alone)

    def alone(self, client: StackedClient, call: TrainCall) -> StepPlan:
        """The plan of a call that trains without other clients'."""
        config, device = client.train_config, client.device
        if call.has_rows and call.simple(client) and captures_step(config, device, call.phases):
            return self.graphed_step
        if call.has_rows and captures_parts(config, device, call.phases, client.model, client.data.tasks):
            return self.graphed_parts
        return self.eager


def step_plans(model: TrainableModule) -> StepPlans:
    """``model``'s step plans, made on first use."""
    return model.attachments.get(StepPlans) or model.attachments.put(StepPlans())


def choose_plan(client: StackedClient, call: TrainCall) -> StepPlan:
    """The one plan that runs ``call``: stacked for a plain update of a one-task client, unobserved, that has rows to
    train on and a lockstep to wait in (``train.batch_clients``), else :meth:`StepPlans.alone`."""
    plans = step_plans(client.model)
    if (client.lockstep is not None and call.plain and call.simple(client) and not call.snapshot_steps
            and call.observe is None and call.has_rows):
        return plans.stacked
    return plans.alone(client, call)
