"""The graphed step plan (``train.cuda_graphs``): a call of one task, one micro-batch a step and a fresh optimizer
replays its whole step (each phase's forward, loss, backward and optimizer step) as a CUDA graph
(:class:`GraphedStep`), which the plan keeps per model, trained set, task, batch shape and phases."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from rayfed.config import TrainConfig
from rayfed.data.batches import TaskData
from rayfed.training.graph_capture import GraphedStep
from rayfed.training.lru import LeastRecentlyUsed
from rayfed.training.penalties import TensorPenalty
from rayfed.training.plans.call import PlanClient, TrainCall, TrainResult, copied, seed_dropout, trained_tensors
from rayfed.training.plans.eager import observed, run_steps
from rayfed.training.steps import CapturedLoss, Phase, RecordedTaskLoss, Step, step_lr

log = logging.getLogger(__name__)
MAX_GRAPHS_PER_MODEL = 4  # each graph keeps a step's activations in a memory pool of its own


def captures_step(config: TrainConfig, device: torch.device, phases: Sequence[Phase]) -> bool:
    """Whether a train call of ``phases`` (one task, one micro-batch a step, a fresh optimizer) may run as a captured
    CUDA graph: ``train.cuda_graphs`` on a GPU, and phases at the call's learning rate, each minimising the task
    loss or a method's :class:`CapturedLoss` (a single phase: also a :class:`RecordedTaskLoss`, and an extra term
    its method declared capturable, a :class:`~rayfed.training.penalties.TensorPenalty`)."""
    if not (config.cuda_graphs and device.type == "cuda" and phases):
        return False
    alone = len(phases) == 1
    return all(phase.lr is None and phase.lr_of is None
               and (phase.loss is None or isinstance(phase.loss, CapturedLoss)
                    or (alone and isinstance(phase.loss, RecordedTaskLoss)))
               and (phase.extra_loss is None or (alone and isinstance(phase.extra_loss, TensorPenalty)))
               for phase in phases)


class GraphedStepPlan:
    """Replays a call's captured step; a call whose step cannot be captured runs eagerly. Keeps the model's graphs,
    the least recently used of :data:`MAX_GRAPHS_PER_MODEL` dropped (a step that could not be captured is kept as None,
    so that it is not tried again)."""

    def __init__(self) -> None:
        self.graphs: LeastRecentlyUsed[tuple, GraphedStep | None] = LeastRecentlyUsed(MAX_GRAPHS_PER_MODEL)

    def run(self, client: PlanClient, call: TrainCall) -> TrainResult:
        config, steps = client.train_config, call.steps
        named = trained_tensors(client, call)
        batches = client.batch_order(call.batches(client), call.purpose, call.pool)
        # Before seeding: a first capture runs warm-up steps, which would draw dropout masks.
        graphed = self.graph(client, named, call.phases)
        if graphed is None:
            return run_steps(client, call, named, batches)
        seed_dropout(client, call)
        snapshots: dict[int, dict[str, torch.Tensor]] = {}
        total_loss = torch.zeros((), device=client.device)  # summed on the device: no wait for the GPU each step
        part, own_loss = client.data.parts[0], call.phases[0].loss
        recorder = own_loss if isinstance(own_loss, RecordedTaskLoss) else None
        for taken, indices in enumerate(batches, start=1):
            batch = {k: v[indices] for k, v in part.train.items()}
            loss = graphed.step(batch, step_lr(config, call.lr, client.round, steps, taken - 1, call.purpose))
            total_loss += loss
            step_view = Step(client, [(client.tasks[part.task], batch)], named, 0, taken - 1, {})
            if recorder is not None:  # the graph's loss is overwritten by the next replay
                recorder.record(step_view, [loss.clone()])
            observed(client, call, step_view)
            if taken in call.snapshot_steps:
                snapshots[taken] = copied(named)
        mean_loss = total_loss / max(steps, 1)
        return TrainResult(copied(named), mean_loss, {part.task: mean_loss} if own_loss is None else {},
                           snapshots=snapshots)

    def graph(self, client: PlanClient, named: dict[str, torch.Tensor], phases: Sequence[Phase]) -> GraphedStep | None:
        """The model's graph for this trained set, task (the forward path: heads, label space), batch shape,
        phases (what each trains, its captured loss's key), optimizer, gradient clipping and penalty (captured on
        first use), its optimizers' state zeroed and the penalty's inputs loaded; None when the step cannot be
        captured (it then runs eagerly). The learning rate is not part of it: each step sets it."""
        config, data, task = client.train_config, client.data, client.tasks[client.task]
        penalty = phases[0].extra_loss
        part: TaskData = data.parts[0]
        batch_size = min(config.batch_size, data.num_train)
        shapes = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in part.train.items())
        losses = tuple((tuple(name for name in named if phase.selects(name)),
                        phase.loss.key if isinstance(phase.loss, CapturedLoss) else None) for phase in phases)
        key = (tuple(named), task.index, batch_size, shapes, losses, config.optimizer, config.weight_decay,
               config.grad_clip, config.autocast, None if penalty is None else penalty.key())

        def capture() -> GraphedStep | None:
            device = next(iter(named.values())).device
            try:
                batch = {name: column[:batch_size].to(device) for name, column in part.train.items()}
                return GraphedStep(client, named, config, batch, task, phases, penalty)
            except RuntimeError as err:  # e.g. a forward that reads a value back to the host mid-step
                log.warning("train.cuda_graphs: the training step of this %s could not be captured as a CUDA graph "
                            "(%s); it trains eagerly.", type(client.model).__name__, str(err).splitlines()[0])
                return None

        graphed = self.graphs.get_or_make(key, capture)
        if graphed is not None:
            graphed.reset_optimizers()
            graphed.load_penalty(penalty)
        return graphed
