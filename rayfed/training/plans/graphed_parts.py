"""The graphed parts plan (``train.cuda_graphs``): a call of one phase of the task loss that the graphed step plan
does not take (a client holding several tasks, ``train.grad_accum`` > 1, a kept optimizer state, learning rates of its
own) replays the forward and backward of each part of its micro-batches as a CUDA graph (:class:`GraphedParts`), and
steps its optimizer eagerly."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from rayfed.config import TrainConfig
from rayfed.models.client import TrainableModule
from rayfed.tasks import Task
from rayfed.training.graph_capture import GraphedParts
from rayfed.training.lru import LeastRecentlyUsed
from rayfed.training.plans.call import PlanClient, TrainCall, TrainResult, trained_tensors
from rayfed.training.plans.eager import add_task_losses, run_steps
from rayfed.training.plans.graphed_step import MAX_GRAPHS_PER_MODEL
from rayfed.training.steps import Phase, RecordedTaskLoss, Step
from rayfed.types import Batch


def captures_parts(config: TrainConfig, device: torch.device, phases: Sequence[Phase], model: TrainableModule,
                   tasks: Sequence[int]) -> bool:
    """Whether a train call of ``phases`` may replay its parts' forwards and backwards as CUDA graphs, its optimizer
    stepped eagerly (at any rates, from any kept state): ``train.cuda_graphs`` on a GPU, one phase of the task loss
    (or a :class:`~rayfed.training.steps.RecordedTaskLoss`) over any trained set, no extra term, and tasks that do
    not share one forward (stacked, they draw other dropout masks than one part at a time)."""
    if not (config.cuda_graphs and device.type == "cuda" and len(phases) == 1):
        return False
    phase = phases[0]
    return ((phase.loss is None or isinstance(phase.loss, RecordedTaskLoss)) and phase.extra_loss is None
            and not (len(tasks) > 1 and model.shares_forward(list(tasks))))


class GraphedPartsPlan:
    """Replays the parts of a call's micro-batches; a call holding a part that cannot be captured runs eagerly. Keeps
    the model's captured parts per trained set (:class:`GraphedParts`, each with its own parts), the least recently
    used of :data:`~rayfed.training.plans.graphed_step.MAX_GRAPHS_PER_MODEL` dropped."""

    def __init__(self) -> None:
        self.families: LeastRecentlyUsed[tuple, GraphedParts] = LeastRecentlyUsed(MAX_GRAPHS_PER_MODEL)

    def run(self, client: PlanClient, call: TrainCall) -> TrainResult:
        named = trained_tensors(client, call)
        # Before seeding: a first capture runs warm-up passes, which would draw dropout masks.
        orders = list(client.batch_order(call.batches(client), call.purpose, call.pool))
        phase = call.phases[0]  # the graphs give gradients only to what it trains, as its optimizer steps only that
        parted = self.family({name: param for name, param in named.items()
                              if phase.selects(name) and param.requires_grad}, client.train_config)
        keys = captured_part_keys(client, parted, orders)
        passes = None if keys is None else functools.partial(replayed_pass, parted, keys)
        return run_steps(client, call, named, iter(orders), passes)

    def family(self, named: dict[str, torch.Tensor], config: TrainConfig) -> GraphedParts:
        """The model's captured parts for this trained set, made on first use."""
        # What every part's graph bakes in besides its own key: the trained set, precision, compilation, accumulation.
        key = (tuple((name, tuple(param.shape), param.dtype) for name, param in named.items()), config.autocast,
               config.compile, config.grad_accum)
        return self.families.get_or_make(key, lambda: GraphedParts(named))


def captured_part_keys(client: PlanClient, parted: GraphedParts,
                       orders: Sequence[torch.Tensor]) -> list[list[tuple]] | None:
    """The keys of the parts of each micro-batch of ``orders`` (:meth:`GraphedParts.key`), with every part not yet
    captured captured; None when one cannot be (the call then trains eagerly)."""
    keys: list[list[tuple]] = []
    wanted: dict[tuple, tuple[Task, Batch, int]] = {}  # a batch kept only for a part not yet captured
    for indices in orders:
        keys.append([])
        for part, rows in client.data.split(indices):
            task, batch = client.tasks[part.task], client.part_batch(part, rows)
            key = parted.key(client.model, task, batch, len(indices))
            keys[-1].append(key)
            if key not in parted.parts and key not in wanted:
                wanted[key] = (task, batch, len(indices))
    return keys if parted.capture(client.model, client.train_config, [k for ks in keys for k in ks], wanted) else None


def replayed_pass(parted: GraphedParts, part_keys: list[list[tuple]], client: PlanClient, phase: Phase,
                  index: int, micro_batches: list[list[tuple[Task, Batch]]], memories: list[dict],
                  named: dict[str, torch.Tensor], step: int, task_sums: dict[int, torch.Tensor],
                  task_counts: dict[int, int]) -> list[torch.Tensor]:
    """:func:`~rayfed.training.plans.eager.eager_pass` of a one-phase step (the task loss or a
    :class:`~rayfed.training.steps.RecordedTaskLoss`) as the parts' graphs (each micro-batch's parts' keys in
    ``part_keys``, by micro-batch of the call), the step's gradients handed to the parameters for the eager optimizer
    step."""
    accum = client.train_config.grad_accum
    keys = part_keys[step * accum:(step + 1) * accum]
    parted.start_step()
    values = []
    for parts, keys_of_parts in zip(micro_batches, keys):
        losses = parted.add_gradients(parts, keys_of_parts)
        step_view = Step(client, parts, named, 0, step, {})
        if phase.loss is None:
            add_task_losses(task_sums, task_counts, parts, losses)
        else:
            phase.loss.record(step_view, losses)
        values.append(step_view.task_loss(losses))
    parted.hand_gradients()
    return values
