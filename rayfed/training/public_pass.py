"""What a method's server-side stages see on an actor of one architecture: the pre-federation stage
(:class:`PreFederation`) and the passes on the run's public data after a round's aggregation (:class:`PublicPass`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from rayfed import seeding
from rayfed.training.client_context import seeded_batches
from rayfed.config import TrainConfig
from rayfed.data.batches import Columns, num_rows
from rayfed.errors import ConfigError
from rayfed.training.precision import mixed_precision
from rayfed.models.peft.lora_groups import groupable, grouped_lora
from rayfed.tasks import Task
from rayfed.types import Batch, TensorDict


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
        for indices in seeded_batches(rows, batch_size, steps, generator, torch.device("cpu")):
            yield {name: column[indices].to(self.device) for name, column in self.public.items()}


@dataclass
class PublicPass:
    """What a method's server-side pass on public data sees on an actor of one architecture (after a round's
    aggregation, :class:`~rayfed.stages.PublicPassStage`): the architecture's model (any trainable values may be
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
            with mixed_precision(self.device, self.train_config.autocast):
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
            with mixed_precision(self.device, self.train_config.autocast):
                value = run.loss(loss, self._answer_logits(self._batch(chosen)), chosen)
            value.backward()
            optimizer.step()
        return {name: p.detach().clone() for name, p in named.items()}

    def train_each(self, jobs: Sequence[PublicJob], loss: PublicLoss, *, epochs: int, batch_size: int,
                   lr: float) -> list[TensorDict]:
        """:meth:`train` of every job (its own values, rows, targets and seeds). When the values are LoRA factors
        and the model has no active dropout (:func:`rayfed.models.peft.lora_groups.groupable`), the jobs still
        running take each step together, one forward and backward over all their batches, each adapter on its own
        rows (a job's last, smaller batch padded with copies of its first row that no loss sees), each with its own
        optimizer state: the numbers of one job at a time up to the order of floating-point sums, in about one job's
        steps."""
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
            with mixed_precision(self.device, self.train_config.autocast):
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
    from rayfed.tasks.kinds import IGNORE

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
