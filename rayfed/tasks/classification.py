"""The built-in kinds that pick one of a task's classes: ``classification`` and ``multiple_choice``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rayfed.tasks.kind_base import TaskKind, check_inputs, image_columns, input_columns, require_column
from rayfed.tasks.texts import prompt_tokens, prompts, tokenize
from rayfed.data.batches import Columns
from rayfed.registry import register_task_kind
from rayfed.types import Batch

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset
    from rayfed.tasks.kind_protocols import HeadTask, TaskModel
    from rayfed.models.backbone import Backbone


@register_task_kind("classification")
class Classification(TaskKind):
    """Images, text or both -> one of the task's classes (cross-entropy)."""

    name = "classification"
    metrics = ("acc", "loss")
    primary = "acc"
    shared_metrics = ("acc",)

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        require_column(dataset, "labels", self.name, where, "class labels")

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        check_inputs(dataset, backbone, self.name, where)

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        columns = input_columns(dataset, indices, backbone)
        columns["labels"] = torch.as_tensor(dataset.labels, dtype=torch.long)[indices]
        return columns

    def build_head(self, backbone: Backbone, task: HeadTask) -> nn.Module:
        return nn.Linear(backbone.feature_dim, task.num_classes)

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs, batch["labels"])

    def score(self, model: TaskModel, batch: Batch) -> dict[str, float]:
        logits = model(batch).float()
        labels = batch["labels"]
        return {"correct": (logits.argmax(dim=1) == labels).sum().item(),
                "loss": nn.functional.cross_entropy(logits, labels, reduction="sum").item()}

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        return {"acc": sums["correct"] / count, "loss": sums["loss"] / count}


# Multiple choice -------------------------------------------------------------------------------------
@register_task_kind("multiple_choice")
class MultipleChoice(Classification):
    """A question and K options -> the right option: each (question, option) pair scored by a linear head on
    the backbone's features, or on a causal LM by the option's log-likelihood after the question."""

    name = "multiple_choice"

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        require_column(dataset, "choices", self.name, where, "the options of each question (data.choices_column)")
        require_column(dataset, "labels", self.name, where, "the index of each question's right option")

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        return {"class_names": dataset.class_names, "num_choices": dataset.choices.shape[1]}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        columns = image_columns(dataset, indices)
        questions, options = prompts(dataset, indices, backbone), dataset.choices[indices]
        if backbone.generates_text:  # the option's likelihood after the question (the assistant's answer in a chat)
            space = "" if backbone.chat_template else " "
            pairs = [f"{q}{space}{option}" for q, row in zip(questions, options) for option in row]
        else:  # the option first, so that a short encoder context truncates the question, not the option
            pairs = [f"{option} : {q}" for q, row in zip(questions, options) for option in row]
        ids, mask = tokenize(pairs, backbone)
        size, choices = options.shape
        columns["input_ids"], columns["attention_mask"] = ids.view(size, choices, -1), mask.view(size, choices, -1)
        if backbone.generates_text:  # the option's own tokens: those after the question's
            question_lengths = torch.as_tensor([len(q) for q in prompt_tokens(questions, backbone)])
            question_lengths = question_lengths.clamp(max=ids.shape[1]).repeat_interleave(choices)
            positions = torch.arange(ids.shape[1]).expand(len(pairs), -1)
            option_mask = (positions >= question_lengths[:, None]) & mask.bool()
            columns["option_mask"] = option_mask.view(size, choices, -1)
        columns["labels"] = torch.as_tensor(dataset.labels, dtype=torch.long)[indices]
        return columns

    def build_head(self, backbone: Backbone, task: HeadTask) -> nn.Module | None:
        return None if backbone.generates_text else nn.Linear(backbone.feature_dim, 1)

    def forward(self, model: TaskModel, batch: Batch) -> torch.Tensor:
        size, choices, length = batch["input_ids"].shape
        flat = {"input_ids": batch["input_ids"].reshape(-1, length),
                "attention_mask": batch["attention_mask"].reshape(-1, length)}
        for name in ("pixel_values", "image_counts"):
            if name in batch:
                flat[name] = batch[name].repeat_interleave(choices, dim=0)
        if "option_mask" not in batch:
            return model.head(model.features(flat)).view(size, choices)
        log_probs = model.lm_logits(flat)[:, :-1].float().log_softmax(dim=-1)
        taken = log_probs.gather(-1, flat["input_ids"][:, 1:, None]).squeeze(-1)
        return (taken * batch["option_mask"].reshape(-1, length)[:, 1:]).sum(dim=1).view(size, choices)
