"""Local training and evaluation of one client, as methods call them from their hooks.

:meth:`ClientContext.train` runs minibatch steps from given parameter values. By default each step
minimises the client's task loss (a client holding several tasks: ``sum_o lambda_o loss_o`` with
``lambda_o`` the task's share of the batch) with one optimizer over every trained parameter. A method
may instead pass

- ``loss``: a function of the :class:`Step` (the batch, the model, its outputs, extra forwards with
  other parameter values such as a frozen teacher's) returning the loss to minimise;
- ``phases``: several optimizer steps per batch, each over its own parameters with its own loss and
  learning rate (FedDAT's two sequential updates);
- ``optimizer_state``: the optimizer's state from an earlier call (``TrainResult.optimizer_state``), to
  keep it across rounds;

and ``train.grad_accum`` micro-batches make one optimizer step; ``train.schedule`` may key the learning
rate to the round.
"""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from rayfed import seeding
from rayfed.config import StreamConfig, TrainConfig
from rayfed.data.batches import ClientData, Columns, EvalSet, TaskData, num_rows
from rayfed.errors import ConfigError
from rayfed.lora_groups import groupable, grouped_lora
from rayfed.metrics import with_derived
from rayfed.modules import select_task
from rayfed.streams import seen_round, training_pool
from rayfed.tasks import Task
from rayfed.types import Batch, Loss, TensorDict

if TYPE_CHECKING:
    from rayfed.kinds import TaskKind

log = logging.getLogger(__name__)

# An extra loss term computed from the live trainable parameters (e.g. a proximal term).
Penalty = Callable[[dict[str, torch.Tensor]], torch.Tensor]
LossFn = Callable[["Step"], torch.Tensor]


@dataclass
class TrainResult:
    params: TensorDict
    loss: Loss  # mean training loss over the steps taken (the first phase's), left on the device
    task_losses: dict[int, Loss] = field(default_factory=dict)  # per task: mean loss over the micro-batches holding it
    optimizer_state: TensorDict | None = None  # with keep_optimizer_state: to pass back in a later call
    snapshots: dict[int, TensorDict] = field(default_factory=dict)  # with snapshot_steps: params after those steps


class StackedTrainer(Protocol):
    """What ``ClientContext.lockstep`` is (:class:`rayfed.batching.Lockstep`, which builds on this module): it
    trains a plain update of one client stacked with other clients' and returns its result."""

    def train(self, client: ClientContext, params: TensorDict, steps: int, purpose: str, lr: float,
              extra_loss: Penalty | None, pool: torch.Tensor | None) -> TrainResult: ...


@dataclass(frozen=True)
class Phase:
    """One optimizer step per batch: the parameters it updates (``trains``: names, a predicate, or None for
    every trained parameter), the loss it minimises (None: the task loss), and its learning rate(s)."""

    trains: Collection[str] | Callable[[str], bool] | None = None
    loss: LossFn | None = None
    lr: float | None = None
    lr_of: Callable[[str], float | None] | None = None  # a parameter's own lr (None: the phase's)
    extra_loss: Penalty | None = None

    def selects(self, name: str) -> bool:
        if self.trains is None:
            return True
        return self.trains(name) if callable(self.trains) else name in self.trains


class Step:
    """What a loss function sees for one micro-batch: the batch (per task, for a client holding several),
    the model with the values being trained, and ways to run it."""

    def __init__(self, client: ClientContext, parts: list[tuple[Task, Batch]], named: dict[str, torch.Tensor],
                 phase: int, index: int, memory: dict):
        self.client = client
        self.model = client.model
        self.parts = parts
        self.params = named  # the live trained tensors, by name
        self.phase = phase
        self.index = index  # the optimizer step's number in this call
        self.memory = memory  # shared by the phases of one micro-batch (e.g. a logit from phase 0 for phase 1)

    @property
    def task(self) -> Task:
        """The task of a single-task batch."""
        return self._single()[0]

    @property
    def batch(self) -> Batch:
        """The named columns of a single-task batch."""
        return self._single()[1]

    def _single(self) -> tuple[Task, Batch]:
        if len(self.parts) != 1:
            raise ValueError(f"this batch holds {len(self.parts)} tasks; use Step.parts")
        return self.parts[0]

    def outputs(self, part: int = 0) -> torch.Tensor:
        """The model's outputs on ``parts[part]``, with the values being trained."""
        task, batch = self.parts[part]
        select_task(self.model, task.index)
        return trained_forward(self.model, self.client.train_config)(batch)

    def raw_and_scored(self, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's outputs on ``parts[part]`` as distillation compares them and as the task's kind scores them
        (:meth:`rayfed.models.TrainableModule.raw_and_scored`), with the values being trained."""
        task, batch = self.parts[part]
        select_task(self.model, task.index)
        return self.model.raw_and_scored(batch, trained_forward(self.model, self.client.train_config))

    def forward(self, params: TensorDict, part: int = 0) -> torch.Tensor:
        """The model's outputs on ``parts[part]`` with ``params`` in place of the live values of those
        parameters (a frozen teacher, the received global model); no gradient reaches ``params``."""
        task, batch = self.parts[part]
        select_task(self.model, task.index)
        with torch.no_grad():
            return torch.func.functional_call(self.model, params, (batch,), strict=False)

    def part_losses(self, outputs: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Each task's own loss on its part of the batch (from ``outputs``, else a forward of each part, or one
        forward of the parts stacked where the model runs their tasks through the same forward)."""
        if outputs is None:
            outputs = self._stacked_outputs() or [self.outputs(i) for i in range(len(self.parts))]
        return [task.kind.loss(out, batch) for (task, batch), out in zip(self.parts, outputs)]

    def _stacked_outputs(self) -> list[torch.Tensor] | None:
        stacked = stacked_forward_batch(self.model, self.parts)
        if stacked is None:
            return None
        select_task(self.model, self.parts[0][0].index)
        outputs = trained_forward(self.model, self.client.train_config)(stacked)
        return list(outputs.split([num_rows(batch) for _, batch in self.parts]))

    def task_loss(self, losses: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """``sum_o lambda_o loss_o`` over the batch's tasks (lambda_o: task o's share of the samples)."""
        losses = list(losses) if losses is not None else self.part_losses()
        if len(losses) == 1:
            return losses[0]
        total = sum(num_rows(batch) for _, batch in self.parts)
        return sum(loss * (num_rows(batch) / total) for loss, (_, batch) in zip(losses, self.parts))


@dataclass
class PreFederation:
    """What a method's pre-federation stage sees on an actor of one architecture: its model (with the round-0
    values of every trainable parameter, ``initial``), the run's public data (``data.public``) encoded for this
    architecture's backbone, and a seeded stream of public batches."""

    architecture: str
    model: nn.Module
    initial: TensorDict
    public: Columns
    public_task: Task | None
    train_config: TrainConfig
    device: torch.device
    seed: int

    def batches(self, batch_size: int, steps: int, purpose: str = "pre_federation") -> Iterator[Batch]:
        """``steps`` batches of the public data (successive seeded epochs), on the device."""
        rows = num_rows(self.public)
        generator = seeding.torch_generator(self.seed, 0, seeding.SERVER, f"{purpose}:{self.architecture}")
        for indices in _batches(rows, batch_size, steps, generator, torch.device("cpu")):
            yield {name: column[indices].to(self.device) for name, column in self.public.items()}


@dataclass
class PublicPass:
    """What a method's server-side pass on public data sees on an actor of one architecture (after a round's
    aggregation, :attr:`~rayfed.method.Method.public_passes`): the architecture's model (any trainable values may be
    loaded into it; each client's update loads its own again), the run's public data (``data.public``, a
    text-generation task) encoded for this backbone, and seeded trainers. Outputs and losses are taken at the answer
    positions (label != ignore after the causal shift), teacher-forced on the reference answer, in eval mode."""

    architecture: str
    model: nn.Module
    public: Columns
    public_task: Task | None
    train_config: TrainConfig
    device: torch.device
    seed: int
    round_idx: int

    def rows(self, count: int) -> torch.Tensor:
        """The first ``count`` public rows (one sentence when there are fewer, or no public data)."""
        available = num_rows(self.public) if self.public else 0
        if available < count:
            raise ConfigError(f"data.public has {available} rows, but the method distils on {count} public samples; "
                              "set data.public (a text-generation source) with at least that many.")
        return torch.arange(count)

    def _batch(self, rows: torch.Tensor) -> Batch:
        return {name: column[rows].to(self.device) for name, column in self.public.items()}

    def _answer_logits(self, batch: Batch) -> torch.Tensor:
        """The model's logits at the batch's answer positions, row by row: [answer tokens, vocabulary]."""
        logits = self.public_task.kind.forward(self.model, batch)
        return logits[:, :-1][answer_mask(batch)].float()

    def answers(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference answer's tokens at the answer positions of ``rows`` ([answer tokens]) and the row of each."""
        batch = {name: self.public[name][rows] for name in ("labels",)}
        mask = answer_mask(batch)
        row_of = rows.unsqueeze(1).expand_as(mask)[mask]
        return batch["labels"][:, 1:][mask], row_of

    @torch.no_grad()
    def answer_logits(self, params: TensorDict, rows: torch.Tensor) -> torch.Tensor:
        """The logits of the model with ``params`` at the answer positions of ``rows`` (eval mode, no dropout),
        [answer tokens, vocabulary], on the CPU."""
        self.model.load_trainable(params)
        self.model.eval()
        size = self.train_config.eval_batch_size
        parts = []
        for first in range(0, len(rows), size):
            with mixed_precision(self.device):
                parts.append(self._answer_logits(self._batch(rows[first:first + size])).cpu())
        return torch.cat(parts)

    def train(self, params: TensorDict, loss: PublicLoss, rows: torch.Tensor, targets: torch.Tensor, *, epochs: int,
              batch_size: int, lr: float, purpose: str) -> TensorDict:
        """``params`` trained by AdamW (weight decay 0) at ``lr``, ``epochs`` passes over ``rows`` in seeded
        batches of ``batch_size``, minimising ``loss(student answer logits, their targets, the answer tokens)``;
        ``targets``: one row per answer token of ``rows`` in the order :meth:`answers` gives them. The seeds depend
        on the round, the architecture and ``purpose``. Empty ``rows``: no step at all."""
        params = {name: value.to(self.device) for name, value in params.items()}
        if not len(rows):
            return {name: value.detach().clone() for name, value in params.items()}
        run = _PublicRun(self, PublicJob(params, rows, targets, purpose), epochs, batch_size)
        self.model.load_trainable(params)
        named = {name: p for name, p in self.model.named_parameters() if name in params}
        self.model.train()
        torch.manual_seed(run.dropout_seed)
        optimizer = torch.optim.AdamW(list(named.values()), lr=lr, weight_decay=0.0)
        for chosen in run.batches:
            optimizer.zero_grad(set_to_none=True)
            with mixed_precision(self.device):
                value = run.loss(loss, self._answer_logits(self._batch(chosen)), chosen)
            value.backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in named.items()}

    def train_each(self, jobs: Sequence[PublicJob], loss: PublicLoss, *, epochs: int, batch_size: int,
                   lr: float) -> list[TensorDict]:
        """:meth:`train` of every job (its own values, rows, targets and seeds). When the values are LoRA factors
        and the model has no active dropout (:func:`rayfed.lora_groups.groupable`), the jobs still running take
        each step together, one forward and backward over all their batches, each adapter on its own rows (a job's
        last, smaller batch padded with copies of its first row that no loss sees), each with its own optimizer state:
        the numbers of one job at a time up to the order of floating-point sums, in about one job's steps."""
        running = [job for job in jobs if len(job.rows)]
        if len(running) < 2 or not groupable(self.model, list(running[0].params)):
            return [self.train(job.params, loss, job.rows, job.targets, epochs=epochs, batch_size=batch_size, lr=lr,
                               purpose=job.purpose) for job in jobs]
        live = dict(self.model.named_parameters())
        values = [{name: value.to(device=self.device, dtype=live[name].dtype).clone().requires_grad_(True)
                   for name, value in job.params.items()} for job in jobs]
        runs = {index: _PublicRun(self, job, epochs, batch_size) for index, job in enumerate(jobs) if len(job.rows)}
        # One optimizer over every job's tensors: a job's tensors keep their own state and step only when it does
        # (a tensor without a gradient is skipped), in one multi-tensor update a step.
        optimizer = torch.optim.AdamW([value for index in runs for value in values[index].values()], lr=lr,
                                      weight_decay=0.0, foreach=True)
        self.model.train()
        torch.manual_seed(runs[max(runs)].dropout_seed)  # the global stream as training one job at a time leaves it
        for step in range(max(len(run.batches) for run in runs.values())):
            stepping = [index for index, run in runs.items() if step < len(run.batches)]
            chosen = [runs[index].batches[step] for index in stepping]
            size = max(len(rows) for rows in chosen)
            batch = self._batch(torch.cat([torch.cat([rows, rows[:1].repeat(size - len(rows))]) for rows in chosen]))
            optimizer.zero_grad(set_to_none=True)
            with mixed_precision(self.device):
                with grouped_lora(self.model, [values[index] for index in stepping]):
                    logits = self.public_task.kind.forward(self.model, batch)[:, :-1]
                mask = answer_mask(batch)
                total = sum(runs[index].loss(loss, logits[group][mask[group]].float(), rows)
                            for index, rows, group in zip(stepping, chosen,
                                                          (slice(g * size, g * size + len(rows))
                                                           for g, rows in enumerate(chosen))))
            total.backward()
            optimizer.step()
        return [{name: value.detach().clone() for name, value in job_values.items()} for job_values in values]


PublicLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PublicJob:
    """One adapter's training on public rows (:meth:`PublicPass.train_each`): its values, the rows it trains on,
    their targets (one per answer token of ``rows``, in the order :meth:`PublicPass.answers` gives them) and the
    purpose its seeds depend on."""

    params: TensorDict
    rows: torch.Tensor
    targets: torch.Tensor
    purpose: str


class _PublicRun:
    """A :class:`PublicJob`'s seeded batches of rows (epoch after epoch), its answer tokens and its loss on a batch."""

    def __init__(self, stage: PublicPass, job: PublicJob, epochs: int, batch_size: int):
        self.job, self.device = job, stage.device
        self.answers, row_of = stage.answers(job.rows)
        self.tokens_of = {int(row): (row_of == row).nonzero().flatten() for row in job.rows}
        seed_name = f"{job.purpose}:{stage.architecture}"
        self.dropout_seed = seeding.torch_seed(stage.seed, stage.round_idx, seeding.SERVER, f"{seed_name}:dropout")
        generator = seeding.torch_generator(stage.seed, stage.round_idx, seeding.SERVER, seed_name)
        self.batches: list[torch.Tensor] = []
        for _ in range(epochs):
            order = job.rows[torch.randperm(len(job.rows), generator=generator)]
            self.batches += [order[first:first + batch_size] for first in range(0, len(order), batch_size)]

    def loss(self, loss: PublicLoss, student: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``loss`` at the answer-position logits ``student`` of the batch of rows ``chosen``."""
        tokens = torch.cat([self.tokens_of[int(row)] for row in chosen])
        return loss(student, self.job.targets[tokens].to(self.device), self.answers[tokens].to(self.device))


def answer_mask(batch: Batch) -> torch.Tensor:
    """Where a text batch's logits predict an answer token (label != ignore after the causal shift)."""
    from rayfed.kinds import IGNORE

    return batch["labels"][:, 1:] != IGNORE


def same_answers(results: dict[str, TensorDict], method: str) -> None:
    """One sentence unless every architecture's public pass saw the same answer tokens (``answers``) and gave
    logits over the same vocabulary (``vocabulary``): distillation between them needs one tokenizer."""
    first, *others = results
    for other in others:
        if not (torch.equal(results[first]["answers"], results[other]["answers"])
                and int(results[first]["vocabulary"]) == int(results[other]["vocabulary"])):
            raise ConfigError(f"methods ({method}) distils between architectures {first!r} and {other!r} at the answer "
                              "tokens of data.public, which they tokenize differently; give them one tokenizer.")


def token_losses(logits: torch.Tensor, answers: torch.Tensor, row_of: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each of ``rows``' mean cross-entropy over its answer tokens, from answer-position ``logits``."""
    per_token = nn.functional.cross_entropy(logits.float(), answers, reduction="none")
    return torch.stack([per_token[row_of == row].mean() for row in rows])


def stacked_forward_batch(model: nn.Module, parts: Sequence[tuple[Task, Batch]]) -> Batch | None:
    """The parts' forward inputs (:attr:`~rayfed.kinds.TaskKind.forward_inputs`) stacked into one batch, when the
    model runs all their tasks through one forward (``shares_forward``) and the inputs agree past the rows; else
    None. A client holding several tasks then trains each step with one forward and one backward, not one per task."""
    if len(parts) < 2 or not model.shares_forward([task.index for task, _ in parts]):
        return None
    names = parts[0][0].kind.forward_inputs
    batches = [{name: column for name, column in batch.items() if names is None or name in names} for _, batch in parts]
    first = batches[0]
    if any(batch.keys() != first.keys() or any(
            batch[name].shape[1:] != first[name].shape[1:] or batch[name].dtype != first[name].dtype for name in first)
           for batch in batches):
        return None
    return {name: torch.cat([batch[name] for batch in batches]) for name in first}


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


class ClientContext:
    """One client as a method sees it inside its actor: its data, the model, a seeded trainer."""

    def __init__(
        self, client_id: int, round_idx: int, seed: int, data: ClientData, model: nn.Module,
        train_config: TrainConfig, device: torch.device, eval_sets: Sequence[EvalSet] = (),
        tasks: Sequence[Task] = (), stream: StreamConfig | None = None, others: Sequence[OtherTask] = (),
    ):
        self.client_id = client_id
        self.round = round_idx
        self.seed = seed
        self.data = data
        self.model = model
        self.train_config = train_config
        self.device = device
        self.eval_sets = eval_sets
        self.tasks = list(tasks)  # the run's tasks, by index
        self.stream = stream  # data arrive over rounds: train on what has arrived, score the tasks seen so far
        self.others = others  # in a stream: other clients' tasks, to score this client's model on
        self.lockstep: StackedTrainer | None = None  # train.batch_clients: plain updates train with other clients'

    @property
    def task(self) -> int:
        """The index of the (first) task the client holds."""
        return self.data.parts[0].task

    @property
    def num_samples(self) -> int:
        return self.data.num_train

    def default_steps(self) -> int:
        return local_steps(self.train_config, self.data.num_train)

    def train(
        self, params: TensorDict, *, steps: int | None = None, purpose: str = "train",
        extra_loss: Penalty | None = None, lr: float | None = None, loss: LossFn | None = None,
        phases: Sequence[Phase] | None = None, optimizer_state: TensorDict | None = None,
        keep_optimizer_state: bool = False, snapshot_steps: Sequence[int] = (),
    ) -> TrainResult:
        """Run ``steps`` optimizer steps from ``params``; batches and dropout seeded by (round, client, purpose).

        Without ``phases``: one phase over every parameter in ``params``, minimising ``loss`` (default: the
        task loss) plus ``extra_loss``, at ``lr`` (default: the config's, on its schedule). Under
        ``train.batch_clients`` (the actor sets ``lockstep``) such a plain update of a one-task client trains
        stacked with other clients' (:mod:`rayfed.batching`).

        ``snapshot_steps``: also the parameters after each of these steps (``TrainResult.snapshots``), bitwise
        what a call of that many steps gives: batches, dropout and (unscheduled) learning rates do not depend on
        the number of steps, so one call of ``2k`` steps holds the call of ``k``."""
        config = self.train_config
        steps = self.default_steps() if steps is None else steps
        if any(not 0 < k <= steps for k in snapshot_steps):
            raise ValueError(f"snapshot_steps {list(snapshot_steps)} must lie in 1..{steps}")
        if snapshot_steps and config.schedule != "constant" and purpose == "train":
            raise ValueError("snapshot_steps needs learning rates that do not depend on the number of steps")
        base_lr = lr or config.lr
        # One task, one micro-batch a step, a fresh optimizer: what a captured or a stacked step can run.
        simple = (len(self.data.parts) == 1 and config.grad_accum == 1 and optimizer_state is None
                  and not keep_optimizer_state)
        pool = self.arrived_rows()
        if (self.lockstep is not None and phases is None and loss is None and simple and not snapshot_steps
                and (pool is None or len(pool))):
            return self.lockstep.train(self, params, steps, purpose, base_lr, extra_loss, pool)
        phases = list(phases) if phases is not None else [Phase(loss=loss, extra_loss=extra_loss)]
        self.model.load_trainable(params)
        named = {name: p for name, p in self.model.named_parameters() if name in params}
        self.model.train()
        graphed = None
        if (config.cuda_graphs and self.device.type == "cuda" and len(phases) == 1 and phases[0].loss is None
                and phases[0].extra_loss is None and simple):
            # Before seeding: a first capture runs warm-up steps, which would draw dropout masks.
            graphed = _graphed_step(self.model, named, config, base_lr, self.data, self.tasks[self.task])
        torch.manual_seed(seeding.torch_seed(self.seed, self.round, self.client_id, purpose + ":dropout"))
        snapshots: dict[int, TensorDict] = {}

        def snapshot(taken: int) -> None:
            if taken in snapshot_steps:
                snapshots[taken] = {n: p.detach().clone() for n, p in named.items()}

        if pool is not None and len(pool) == 0:  # nothing has arrived yet
            for taken in snapshot_steps:
                snapshot(taken)
            return TrainResult({n: p.detach().clone() for n, p in named.items()}, float("nan"), snapshots=snapshots)
        batches = self.batch_order(steps * config.grad_accum, purpose, pool)
        # Summed on the device: reading each step's loss would make the host wait for the GPU every step.
        total_loss = torch.zeros((), device=self.device)
        if graphed is not None:
            part = self.data.parts[0]
            for taken, indices in enumerate(batches, start=1):
                total_loss += graphed.step({k: v[indices] for k, v in part.train.items()})
                snapshot(taken)
            return TrainResult({n: p.detach().clone() for n, p in named.items()}, total_loss / max(steps, 1),
                               snapshots=snapshots)
        optimizers = [self._optimizer(phase, named, base_lr) for phase in phases]
        if optimizer_state is not None:
            _load_optimizer_state(optimizers, phases, named, optimizer_state)
        task_sums: dict[int, torch.Tensor] = {}
        task_counts: dict[int, int] = {}
        for step in range(steps):
            if config.schedule != "constant" and purpose == "train":
                for optimizer in optimizers:
                    for group in optimizer.param_groups:
                        group["lr"] = scheduled_lr(config, group["base_lr"], self.round, self.round * steps + step)
            micro_batches = [self._micro_batch(next(batches)) for _ in range(config.grad_accum)]
            memories: list[dict] = [{} for _ in micro_batches]
            for index, (phase, optimizer) in enumerate(zip(phases, optimizers)):
                optimizer.zero_grad(set_to_none=True)
                for parts, memory in zip(micro_batches, memories):
                    step_view = Step(self, parts, named, index, step, memory)
                    with mixed_precision(self.device):
                        if phase.loss is None:
                            losses = step_view.part_losses()
                            value = step_view.task_loss(losses)
                            if index == 0:
                                _add_task_losses(task_sums, task_counts, parts, losses)
                        else:
                            value = phase.loss(step_view)
                    if index == 0:
                        total_loss += value.detach().float() / config.grad_accum
                    if phase.extra_loss is not None:
                        value = value + phase.extra_loss(named)
                    if config.grad_accum > 1:
                        value = value / config.grad_accum
                    value.backward()
                trained = [p for group in optimizer.param_groups for p in group["params"]]
                if config.grad_clip is not None:
                    nn.utils.clip_grad_norm_(trained, config.grad_clip)
                optimizer.step()
            snapshot(step + 1)
        task_losses = {task: task_sums[task] / task_counts[task] for task in task_sums}
        state = _optimizer_state(optimizers, named) if keep_optimizer_state else None
        return TrainResult({n: p.detach().clone() for n, p in named.items()}, total_loss / max(steps, 1),
                           task_losses, state, snapshots)

    def batch_order(self, batches: int, purpose: str, pool: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """The rows of each of ``batches`` micro-batches of a train call, seeded by (round, client, purpose), drawn
        from ``pool`` (:meth:`arrived_rows`)."""
        generator = seeding.torch_generator(self.seed, self.round, self.client_id, purpose + ":batches")
        first_column = next(iter(self.data.parts[0].train.values()))
        return _batches(self.data.num_train, self.train_config.batch_size, batches, generator, first_column.device,
                        pool)

    def arrived_rows(self) -> torch.Tensor | None:
        """In a stream, the training rows local training may draw from this round (None: all)."""
        arrival = self.data.arrival
        if self.stream is None or arrival is None:
            return None
        rows = training_pool(self.stream, self.seed, self.client_id, self.round, arrival, self.data.task_of_row)
        return torch.as_tensor(rows, dtype=torch.long)

    def _optimizer(self, phase: Phase, named: dict[str, torch.Tensor], lr: float) -> torch.optim.Optimizer:
        phase_lr = phase.lr or lr
        groups: dict[float, list[torch.Tensor]] = {}
        for name, param in named.items():
            if phase.selects(name):
                own = phase.lr_of(name) if phase.lr_of is not None else None
                groups.setdefault(own or phase_lr, []).append(param)
        optimizer = build_optimizer(self.train_config, [{"params": ps, "lr": group_lr} for group_lr, ps in groups.items()],
                               phase_lr)
        for group in optimizer.param_groups:
            group["base_lr"] = group["lr"]
        return optimizer

    def _micro_batch(self, indices: torch.Tensor) -> list[tuple[Task, Batch]]:
        return [(self.tasks[part.task], {k: v[rows].to(self.device, non_blocking=True) for k, v in part.train.items()})
                for part, rows in self.data.split(indices)]

    @torch.no_grad()
    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """The metrics of each of the client's tasks on its own test data (personalization), ``local_<metric>``
        (``<task>/local_<metric>`` for a client holding several tasks), and on each shared evaluation set
        ``<set>_<metric>``; plus the metrics derived from these (:mod:`rayfed.metrics`)."""
        self.model.load_trainable(params)
        self.model.eval()
        metrics: dict[str, float] = {}
        seen = self.data.parts if self.stream is None else [p for p in self.data.parts if p.first_round <= seen_round(self.round)]
        others = [] if self.stream is None else [o for o in self.others if o.first_round <= seen_round(self.round)]
        # Scored together where the model allows: the own tasks and the others that need no parameters of their own.
        together = iter(self._score_tasks([(part.task, part.test) for part in seen]
                                          + [(other.task, other.test) for other in others if not other.missing]))
        own_primary: list[tuple[str, float]] = []
        for part in seen:
            task = self.tasks[part.task]
            values = task.kind.summarize(*next(together))
            prefix = "" if len(self.data.parts) == 1 else f"{task.name}/"
            metrics.update({f"{prefix}local_{name}": value for name, value in values.items()})
            if task.kind.primary in values:  # a plug-in kind may report other metrics than its parent's primary
                own_primary.append((task.kind.primary, values[task.kind.primary]))
        if self.stream is not None:
            metrics.update(_task_means("self", own_primary))
            other_primary = []
            for other in others:
                task = self.tasks[other.task]
                if other.missing:
                    select_task(self.model, other.task)
                    self.model.load_trainable(other.missing)  # the other task's own parameters: their round-0 values
                    sums = self._score(task, other.test)
                else:
                    sums = next(together)
                values = task.kind.summarize(*sums)
                if task.kind.primary in values:
                    other_primary.append((task.kind.primary, values[task.kind.primary]))
                    if self.stream.others_by_task:
                        metrics[f"others/{task.name}_{task.kind.primary}"] = values[task.kind.primary]
            self.model.load_trainable(params)
            metrics.update(_task_means("others", other_primary))
        for eval_set in self.eval_sets:
            columns = eval_set.columns
            if eval_set.exclude_own_classes:
                own = torch.cat([part.train["labels"] for part in self.data.parts]).unique()
                keep = ~torch.isin(columns["labels"], own.to(columns["labels"].device))
                columns = {name: column[keep] for name, column in columns.items()}
            task = self.tasks[eval_set.task]
            select_task(self.model, eval_set.task)
            values = task.kind.summarize(*self._score(task, columns))
            metrics.update({f"{eval_set.name}_{name}": values[name] for name in task.kind.shared_metrics})
        if self.eval_sets:
            select_task(self.model, self.task)
        return with_derived(metrics)

    def _score(self, task: Task, columns: Columns) -> tuple[dict[str, float], int]:
        """The task kind's sums over ``columns``, scored in batches of ``eval_batch_size``, and the row count."""
        sums: dict[str, float] = {}
        for batch in self._test_batches(columns):
            with mixed_precision(self.device):
                scored = task.kind.score(self.model, batch)
            for name, value in scored.items():
                sums[name] = sums.get(name, 0.0) + value
        return sums, num_rows(columns)

    def _score_tasks(self, items: Sequence[tuple[int, Columns]]) -> list[tuple[dict[str, float], int]]:
        """Each (task index, test columns)'s sums and row count. The test sets of tasks that the model runs through
        one forward and whose kind can merge them are scored as one set: one pass of batched generations for a
        client's every text-generation task, not one per task."""
        scored: dict[int, tuple[dict[str, float], int]] = {}
        by_kind: dict[type, list[int]] = {}
        for position, (task_index, _) in enumerate(items):
            by_kind.setdefault(type(self.tasks[task_index].kind), []).append(position)
        pad_token_id = getattr(getattr(self.model, "tokenizer", None), "pad_token_id", None)
        for positions in by_kind.values():
            task_indices = [items[position][0] for position in positions]
            kind = self.tasks[task_indices[0]].kind
            merged = None
            if len(positions) > 1 and self.model.shares_forward(task_indices):
                merged = kind.merge_columns([items[position][1] for position in positions], pad_token_id)
            if merged is None:
                for position, task_index in zip(positions, task_indices):
                    select_task(self.model, task_index)
                    scored[position] = self._score(self.tasks[task_index], items[position][1])
                continue
            select_task(self.model, task_indices[0])
            rows = self._score_rows(kind, merged)
            first = 0
            for position in positions:
                count = num_rows(items[position][1])
                scored[position] = ({name: float(values[first:first + count].sum()) for name, values in rows.items()},
                                    count)
                first += count
        return [scored[position] for position in range(len(items))]

    def _score_rows(self, kind: TaskKind, columns: Columns) -> dict[str, torch.Tensor]:
        """``kind``'s values of every row of ``columns``, scored in batches of ``eval_batch_size`` (a value some
        batches lack is dropped)."""
        values: dict[str, list[torch.Tensor]] = {}
        batches = 0
        for batch in self._test_batches(columns):
            with mixed_precision(self.device):
                for name, rows in kind.score_rows(self.model, batch).items():
                    values.setdefault(name, []).append(rows)
            batches += 1
        return {name: torch.cat(parts) for name, parts in values.items() if len(parts) == batches}

    def _test_batches(self, columns: Columns) -> Iterator[Batch]:
        size = self.train_config.eval_batch_size
        for start in range(0, num_rows(columns), size):
            yield {name: column[start:start + size].to(self.device) for name, column in columns.items()}


@dataclass
class OtherTask:
    """In a stream, another client's task a client is also scored on: its test samples (every holder's), the
    first round any holder's samples of it arrive in, and the task's own parameters the client lacks (at
    their round-0 values)."""

    task: int
    test: Columns
    first_round: int
    missing: TensorDict = field(default_factory=dict)


def _task_means(group: str, values: list[tuple[str, float]]) -> dict[str, float]:
    """``<group>_<metric>``: the mean of each primary metric over the tasks that report it."""
    by_metric: dict[str, list[float]] = {}
    for metric, value in values:
        by_metric.setdefault(metric, []).append(value)
    return {f"{group}_{metric}": sum(vs) / len(vs) for metric, vs in by_metric.items()}


def _add_task_losses(sums: dict[int, torch.Tensor], counts: dict[int, int], parts: list[tuple[Task, Batch]],
                     losses: list[torch.Tensor]) -> None:
    for (task, _), loss in zip(parts, losses):
        loss = loss.detach().float()
        sums[task.index] = sums[task.index] + loss if task.index in sums else loss
        counts[task.index] = counts.get(task.index, 0) + 1


def local_steps(config: TrainConfig, num_train: int) -> int:
    """Steps of one local update: ``local_steps``, or ``local_epochs`` passes over the client's data."""
    if config.local_epochs is not None:
        return config.local_epochs * math.ceil(num_train / (config.batch_size * config.grad_accum))
    return config.local_steps


def scheduled_lr(config: TrainConfig, base_lr: float, round_idx: int, global_step: int) -> float:
    """``warmup_cosine``: linear warm-up to ``base_lr`` over ``warmup_steps``, then cosine decay to 0 at
    ``decay_steps`` global steps; ``round_warmup``: linear from ``warmup_start_lr`` at round 0 to ``base_lr``
    at round ``warmup_rounds``, then constant."""
    if config.schedule == "round_warmup":
        progress = min(round_idx / config.warmup_rounds, 1.0)
        return config.warmup_start_lr + (base_lr - config.warmup_start_lr) * progress
    if global_step < config.warmup_steps:
        return base_lr * (global_step + 1) / config.warmup_steps
    span = max(config.decay_steps - config.warmup_steps, 1)
    progress = min((global_step - config.warmup_steps) / span, 1.0)
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    config: TrainConfig, params: list[torch.Tensor] | list[dict], lr: float, capturable: bool = False,
) -> torch.optim.Optimizer:
    tensors = [p for group in params for p in group["params"]] if params and isinstance(params[0], dict) else params
    # One fused kernel per step on the GPU instead of a few per tensor: the steps are launch-bound.
    fused = all(p.is_cuda for p in tensors) or None
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=config.momentum, weight_decay=config.weight_decay, fused=fused)
    adam = torch.optim.Adam if config.optimizer == "adam" else torch.optim.AdamW
    return adam(params, lr=lr, weight_decay=config.weight_decay, fused=fused, capturable=capturable)


def _optimizer_state(optimizers: list[torch.optim.Optimizer], named: dict[str, torch.Tensor]) -> TensorDict:
    """Every optimizer's per-parameter state as plain tensors named ``<phase>/<parameter>/<key>``."""
    name_of = {id(p): n for n, p in named.items()}
    state: TensorDict = {}
    for phase, optimizer in enumerate(optimizers):
        for param, values in optimizer.state.items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    state[f"{phase}/{name_of[id(param)]}/{key}"] = value.detach().clone()
    return state


def _load_optimizer_state(optimizers: list[torch.optim.Optimizer], phases: list[Phase], named: dict[str, torch.Tensor],
                          state: TensorDict) -> None:
    for phase, optimizer in enumerate(optimizers):
        saved = optimizer.state_dict()
        order = [id(p) for group in optimizer.param_groups for p in group["params"]]
        names = {id(p): n for n, p in named.items()}
        per_param: dict[int, dict] = {}
        for position, param_id in enumerate(order):
            prefix = f"{phase}/{names[param_id]}/"
            values = {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}
            if values:
                per_param[position] = values
        optimizer.load_state_dict({"state": per_param, "param_groups": saved["param_groups"]})


class GraphedStep:
    """One training step (forward, loss, backward, optimizer step) of one model, trained set, task and batch
    shape, captured once as a CUDA graph and replayed for every client that trains the same set.

    The steps of a foundation model with small adapters are bound by kernel launches (about a thousand
    per step); a replay launches them all at once. Each train call loads the client's values into the
    same parameter tensors and zeroes the optimizer's state in place, which is where a fresh optimizer
    starts; each batch is copied into the static inputs the graph reads.
    """

    def __init__(self, model: nn.Module, named: dict[str, torch.Tensor], config: TrainConfig, lr: float,
                 batch: Batch, task: Task):
        self.optimizer = build_optimizer(config, list(named.values()), lr, capturable=True)
        self.forward = trained_forward(model, config)
        self.batch = {name: column.clone() for name, column in batch.items()}
        self.task = task
        device = next(iter(self.batch.values())).device
        start = {name: param.detach().clone() for name, param in named.items()}
        try:
            side = torch.cuda.Stream(device)  # warm-up off the default stream, as graph capture requires
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*capturable=True.*")  # uncaptured warm-up steps
                for _ in range(3):
                    self.optimizer.zero_grad(set_to_none=True)
                    self._forward_backward_step()
            torch.cuda.current_stream(device).wait_stream(side)
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self._forward_backward_step()
        finally:
            with torch.no_grad():  # undo the warm-up's steps
                for name, param in named.items():
                    param.copy_(start[name])

    def _forward_backward_step(self) -> torch.Tensor:
        device = next(iter(self.batch.values())).device
        with mixed_precision(device, cache_enabled=False):  # no cast cache under capture
            loss = self.task.kind.loss(self.forward(self.batch), self.batch)
        loss.backward()
        self.optimizer.step()
        return loss.detach().float()

    def reset_optimizer(self) -> None:
        for state in self.optimizer.state.values():
            for value in state.values():
                value.zero_()

    def step(self, batch: Batch) -> torch.Tensor:
        """One step on ``batch``; returns its loss (a tensor on the GPU, valid until the next step)."""
        for name, column in batch.items():
            self.batch[name].copy_(column, non_blocking=True)
        self.graph.replay()
        return self.loss


def trained_forward(model: nn.Module, config: TrainConfig) -> nn.Module:
    """What a training step calls: ``model``, or with ``train.compile`` its ``torch.compile``, built once per model.

    Clients' values are loaded into the same parameter tensors, which the compiled code reads as inputs, so one
    compilation (per task and batch shape) serves every client of the model. Before compiling, the model's patch
    embeddings become matrix products (:class:`PatchMatmul`)."""
    if not config.compile:
        return model
    if "_rayfed_compiled" not in model.__dict__:
        for module in model.modules():
            if PatchMatmul.replaces(module):
                # In place, so that parameters, hooks and every reference to the module stay as they are.
                module.__class__ = PatchMatmul
        # Outside nn.Module's attribute hooks: the compiled wrapper must not become a submodule of its model.
        object.__setattr__(model, "_rayfed_compiled", torch.compile(model))
    return model.__dict__["_rayfed_compiled"]


class PatchMatmul(nn.Conv2d):
    """A convolution whose stride equals its kernel (a ViT's patch embedding), computed as one matrix product of
    the non-overlapping patches with the flattened kernel: the same products and sums. cuDNN runs ViT-B/16's
    at a sixth of the speed of the matrix product (0.59 ms against 0.09 ms at batch 64 on an H200), which was 3%
    of a compiled LoRA step."""

    @staticmethod
    def replaces(module: nn.Module) -> bool:
        """Whether ``module`` is a plain convolution over non-overlapping patches."""
        return (type(module) is nn.Conv2d and module.stride == module.kernel_size and module.dilation == (1, 1)
                and module.groups == 1 and module.padding in ((0, 0), "valid"))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dim() != 4:
            return super().forward(images)
        batch, channels = images.shape[:2]
        kernel_h, kernel_w = self.kernel_size
        rows, cols = images.shape[2] // kernel_h, images.shape[3] // kernel_w
        # A convolution drops the pixels past the last whole patch.
        patches = (images[:, :, : rows * kernel_h, : cols * kernel_w]
                   .reshape(batch, channels, rows, kernel_h, cols, kernel_w)
                   .permute(0, 2, 4, 1, 3, 5)
                   .reshape(batch * rows * cols, channels * kernel_h * kernel_w))
        out = nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.reshape(batch, rows, cols, self.out_channels).permute(0, 3, 1, 2)


MAX_GRAPHS_PER_MODEL = 4  # each graph keeps a step's activations in a memory pool of its own
_GRAPHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphedStep | None]] = weakref.WeakKeyDictionary()


def _graphed_step(model: nn.Module, named: dict[str, torch.Tensor], config: TrainConfig, lr: float,
                  data: ClientData, task: Task) -> GraphedStep | None:
    """The model's graph for this trained set, task (the forward path: heads, label space), batch shape
    and optimizer (captured on first use, the least recently used of :data:`MAX_GRAPHS_PER_MODEL`
    dropped), its optimizer state zeroed; None when the step cannot be captured (it then runs eagerly)."""
    part: TaskData = data.parts[0]
    batch_size = min(config.batch_size, data.num_train)
    shapes = tuple((name, tuple(column.shape[1:]), column.dtype) for name, column in part.train.items())
    key = (tuple(named), task.index, batch_size, shapes, config.optimizer, config.weight_decay, lr)
    graphs = _GRAPHS.setdefault(model, {})
    if key in graphs:
        graphs[key] = graphs.pop(key)  # most recently used last
    else:
        if len(graphs) == MAX_GRAPHS_PER_MODEL:
            del graphs[next(iter(graphs))]
        device = next(iter(named.values())).device
        try:
            graphs[key] = GraphedStep(model, named, config, lr,
                                      {name: column[:batch_size].to(device) for name, column in part.train.items()}, task)
        except RuntimeError as err:  # e.g. a forward that reads a value back to the host mid-step
            log.warning("train.cuda_graphs: the training step of this %s could not be captured as a CUDA graph "
                        "(%s); it trains eagerly.", type(model).__name__, str(err).splitlines()[0])
            graphs[key] = None
    if graphs[key] is not None:
        graphs[key].reset_optimizer()
    return graphs[key]


def _batches(num_samples: int, batch_size: int, steps: int, generator: torch.Generator,
             device: torch.device, pool: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """``steps`` batches from successive seeded permutations (epochs) of the client's samples (of ``pool``,
    the rows a stream has made available, when given).

    The permutations are drawn on the CPU (the same numbers on every device) and moved once per
    epoch to where the data is, so indexing it never waits on a copy. To a GPU they go from pinned memory
    without waiting: a plain copy would make the host wait for every step already queued (the last client's).
    """
    rows = num_samples if pool is None else len(pool)

    def permutation() -> torch.Tensor:
        order = torch.randperm(rows, generator=generator)
        order = order if pool is None else pool[order]
        if device.type == "cuda":
            return order.pin_memory().to(device, non_blocking=True)
        return order.to(device)

    batch_size = min(batch_size, rows)
    order = permutation()
    position = 0
    for _ in range(steps):
        if position + batch_size > rows:
            order = permutation()
            position = 0
        yield order[position:position + batch_size]
        position += batch_size


def mixed_precision(device: torch.device, cache_enabled: bool = True) -> torch.autocast:
    """bf16 autocast on a GPU; nothing on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda", cache_enabled=cache_enabled)


