"""One client as a method's hooks see it inside its actor (:class:`ClientContext`): its data, the model and a
seeded trainer (what one of its steps is: :mod:`rayfed.training.steps`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from rayfed import seeding
from rayfed.config import StreamConfig, TrainConfig
from rayfed.data.batches import ClientData, Columns, EvalSet, TaskData
from rayfed.data.streams import seen_round, training_pool
from rayfed.models.client import TrainableModule
from rayfed.models.peft.modules import select_task
from rayfed.results.derived_metrics import with_derived
from rayfed.tasks import Task
from rayfed.training.optimizers import local_steps
from rayfed.training.plans import Lockstep, TrainCall, TrainResult, choose_plan
from rayfed.training.scoring import Scorer
from rayfed.training.steps import LossFn, Penalty, Phase, StepObserver
from rayfed.types import Batch, TensorDict

__all__ = ["ClientContext", "OtherTask", "TrainResult", "rows_on", "seeded_batches"]


class ClientContext:
    """One client as a method sees it inside its actor: its data, the model, a seeded trainer."""

    def __init__(
        self, client_id: int, round_idx: int, seed: int, data: ClientData, model: TrainableModule,
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
        self.lockstep: Lockstep | None = None  # train.batch_clients: plain updates train with other clients'

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
        keep_optimizer_state: bool = False, snapshot_steps: Sequence[int] = (), observe: StepObserver | None = None,
    ) -> TrainResult:
        """Run ``steps`` optimizer steps from ``params``; batches and dropout seeded by (round, client, purpose).

        Without ``phases``: one phase over every parameter in ``params``, minimising ``loss`` (default: the
        task loss) plus ``extra_loss``, at ``lr`` (default: the config's, on its schedule). Under
        ``train.batch_clients`` (the actor sets ``lockstep``) such a plain update of a one-task client trains
        stacked with other clients'. The call, checked, runs by one step plan (:mod:`rayfed.training.plans`).

        ``snapshot_steps``: also the parameters after each of these steps (``TrainResult.snapshots``), bitwise
        what a call of that many steps gives: batches, dropout and (unscheduled) learning rates do not depend on
        the number of steps, so one call of ``2k`` steps holds the call of ``k``.

        ``observe``: called with each micro-batch's :class:`Step` once its step is taken (the trained values already
        updated), eagerly and under the step's autocast, whichever plan runs the steps (a captured step's too): work a
        method does on the batches it trains on (a statistic, another model's gradient) that the step itself does not
        need, so that the step stays one a CUDA graph may capture. Nothing it computes reaches the trained values."""
        config = self.train_config
        steps = self.default_steps() if steps is None else steps
        if any(not 0 < k <= steps for k in snapshot_steps):
            raise ValueError(f"snapshot_steps {list(snapshot_steps)} must lie in 1..{steps}")
        if snapshot_steps and config.schedule != "constant" and purpose == "train":
            raise ValueError("snapshot_steps needs learning rates that do not depend on the number of steps")
        plain = phases is None and loss is None
        call = TrainCall(params, steps, purpose, lr or config.lr,
                         list(phases) if phases is not None else [Phase(loss=loss, extra_loss=extra_loss)], plain,
                         optimizer_state, keep_optimizer_state, tuple(snapshot_steps), self.arrived_rows(), observe)
        return choose_plan(self, call).run(self, call)

    def batch_order(self, batches: int, purpose: str, pool: torch.Tensor | None) -> Iterator[torch.Tensor]:
        """The rows of each of ``batches`` micro-batches of a train call, seeded by (round, client, purpose), drawn
        from ``pool`` (:meth:`arrived_rows`)."""
        generator = seeding.torch_generator(self.seed, self.round, self.client_id, purpose + ":batches")
        first_column = next(iter(self.data.parts[0].train.values()))
        # Several tasks' rows: split on the host (micro_batch), where the parts' sizes need no read from the GPU.
        device = first_column.device if len(self.data.parts) == 1 else torch.device("cpu")
        return seeded_batches(self.data.num_train, self.train_config.batch_size, batches, generator, device, pool)

    def arrived_rows(self) -> torch.Tensor | None:
        """In a stream, the training rows local training may draw from this round (None: all)."""
        arrival = self.data.arrival
        if self.stream is None or arrival is None:
            return None
        rows = training_pool(self.stream, self.seed, self.client_id, self.round, arrival, self.data.task_of_row)
        return torch.as_tensor(rows, dtype=torch.long)

    def micro_batch(self, indices: torch.Tensor) -> list[tuple[Task, Batch]]:
        """The rows ``indices`` of a train call's micro-batch, by task."""
        return [(self.tasks[part.task], self.part_batch(part, rows)) for part, rows in self.data.split(indices)]

    def part_batch(self, part: TaskData, rows: torch.Tensor) -> Batch:
        """The rows ``rows`` of task data ``part``'s training columns, on the client's device."""
        rows = rows_on(rows, next(iter(part.train.values())).device)
        return {k: v[rows].to(self.device, non_blocking=True) for k, v in part.train.items()}

    @torch.no_grad()
    def evaluate(self, params: TensorDict) -> dict[str, float]:
        """The metrics of each of the client's tasks on its own test data (personalization), ``local_<metric>``
        (``<task>/local_<metric>`` for a client holding several tasks), and on each shared evaluation set
        ``<set>_<metric>``; plus the metrics derived from these (:mod:`rayfed.results.derived_metrics`).

        A model that draws in evaluation (ViLT's patch order, from the host's generator) draws from this client's
        and round's own stream, and the process's generator is left as it was: the numbers do not depend on what
        the actor ran before (the packing, an earlier view)."""
        with torch.random.fork_rng(devices=[]):
            # the host's generator alone: torch.manual_seed would also reseed every GPU's, which fork_rng leaves changed
            torch.random.default_generator.manual_seed(
                seeding.torch_seed(self.seed, self.round, self.client_id, "evaluation"))
            return self._evaluate(params)

    def _evaluate(self, params: TensorDict) -> dict[str, float]:
        self.model.load_trainable(params)
        self.model.eval()
        metrics: dict[str, float] = {}
        seen = self.data.parts if self.stream is None else [p for p in self.data.parts
                                                             if p.first_round <= seen_round(self.round)]
        others = [] if self.stream is None else [o for o in self.others if o.first_round <= seen_round(self.round)]
        # Scored together where the model allows: the own tasks and the others that need no parameters of their own.
        scorer = Scorer(self.model, self.tasks, self.device, self.train_config.eval_batch_size,
                        self.train_config.autocast)
        together = iter(scorer.score_tasks([(part.task, part.test) for part in seen]
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
                    sums = scorer.score(task, other.test)
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
            values = task.kind.summarize(*scorer.score(task, columns))
            metrics.update({f"{eval_set.name}_{name}": values[name] for name in task.kind.shared_metrics})
        if self.eval_sets:
            select_task(self.model, self.task)
        return with_derived(metrics)


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


def seeded_batches(num_samples: int, batch_size: int, steps: int, generator: torch.Generator,
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
        return rows_on(order if pool is None else pool[order], device)

    batch_size = min(batch_size, rows)
    order = permutation()
    position = 0
    for _ in range(steps):
        if position + batch_size > rows:
            order = permutation()
            position = 0
        yield order[position:position + batch_size]
        position += batch_size


def rows_on(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host row indices on ``device``; to a GPU from pinned memory without waiting: a plain copy would make the host
    wait for every step already queued."""
    if device.type == "cuda" and rows.device.type == "cpu":
        return rows.pin_memory().to(device, non_blocking=True)
    return rows.to(device)
