"""Task kinds: what a task's examples become, its loss, and its metrics.

A task kind is a plug-in (:mod:`rayfed.registry`, ``data.kind``): a :class:`TaskKind` subclass that
turns a dataset's columns into named tensors for a backbone (:meth:`TaskKind.encode`), adds a head to
the default client model (:meth:`TaskKind.build_head`), computes the model's outputs and the loss of a
batch, and scores a model on test data. The built-ins:

- ``classification``: images, text or both -> one of the task's classes (VQA as answer classification);
  ``acc``, ``loss``;
- ``multiple_choice``: a question and its options -> the right option, each option scored by a head on
  the backbone's features of (question, option) or, on a causal LM, by the option's log-likelihood;
  ``acc``, ``loss``;
- ``text_generation``: a prompt (and image) -> the target text, a causal LM's next-token loss on the
  target tokens; ``token_f1``, ``exact_match`` and ``meteor`` of greedy generations
  (:mod:`rayfed.tasks.text_metrics`), ``perplexity`` of the target;
- ``reconstruction``: an image -> the same image from the backbone's features through a decoder head;
  ``mse``.

Metrics are reported as ``local_<metric>`` on a client's own test data and ``<set>_<metric>`` on shared
evaluation sets; :attr:`TaskKind.lower_is_better` tells reports which way is better.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from rayfed.tasks import text_metrics
from rayfed.tasks.texts import (  # noqa: F401 (end_of_text_id: where methods import it from)
    end_of_text_id, prompt_tokens, prompts, target_tokens, text_end_id, text_width, tokenize, too_long,
)
from rayfed.data.batches import Columns
from rayfed.tasks.decoders import ImageDecoder
from rayfed.errors import ConfigError
from rayfed.registry import register_task_kind
from rayfed.types import Batch

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset
    from rayfed.tasks.kind_protocols import HeadTask, TaskModel
    from rayfed.models.backbone import Backbone

IGNORE = -100  # label of positions no loss is taken on


class TaskKind:
    """Base class of task kinds; subclasses set the class variables and override the methods."""

    name: ClassVar[str] = ""
    metrics: ClassVar[tuple[str, ...]] = ()  # reported as local_<metric>, in this order
    primary: ClassVar[str] = ""  # the metric streams average over tasks (self_<primary>, others_<primary>)
    shared_metrics: ClassVar[tuple[str, ...]] = ()  # reported on shared evaluation sets as <set>_<metric>
    lower_is_better: ClassVar[frozenset[str]] = frozenset({"loss"})
    forward_inputs: ClassVar[tuple[str, ...] | None] = None  # the columns forward reads (None: it may read any)

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        """Raise one sentence if ``dataset`` lacks the columns this kind needs (``where``: its config section)."""

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        """Raise one sentence if ``backbone`` cannot run this kind on ``dataset``."""

    def check_model(self, model: TaskModel, backbone: Backbone, where: str) -> None:
        """Raise one sentence if a method's ``model`` cannot produce this kind's outputs."""

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        """What a :class:`~rayfed.tasks.Task` of this kind records of its dataset (class names, shapes)."""
        return {"class_names": dataset.class_names}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        """The samples ``indices`` of ``dataset`` as named tensors for ``backbone``."""
        raise NotImplementedError

    def build_head(self, backbone: Backbone, task: HeadTask) -> nn.Module | None:
        """What the default client model adds for this task over the backbone's features (None: nothing)."""
        return None

    def forward(self, model: TaskModel, batch: Batch) -> torch.Tensor:
        """The model's outputs on ``batch``, which :meth:`loss` scores."""
        return model.head(model.features(batch))

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def score(self, model: TaskModel, batch: Batch) -> dict[str, float]:
        """Sums over the test ``batch`` (under ``torch.no_grad``) that :meth:`summarize` turns into metrics."""
        raise NotImplementedError

    def score_rows(self, model: TaskModel, batch: Batch) -> dict[str, torch.Tensor]:
        """:meth:`score`'s values row by row (each a float64 tensor over the batch's rows), for a kind that scores
        several tasks' test sets in one pass (:meth:`merge_columns`)."""
        raise NotImplementedError

    def merge_columns(self, columns: Sequence[Columns], pad_token_id: int | None) -> Columns | None:
        """Several tasks' test columns as one set whose rows :meth:`score_rows` scores each as its own task would,
        for a model that runs these tasks through the same forward; None (the default): score each on its own."""
        return None

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        """The metrics from the sums of every test batch over ``count`` samples."""
        raise NotImplementedError


# Inputs ----------------------------------------------------------------------------------------------
def image_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, C) numpy images, uint8 pixels 0..255 or floats in [0, 1], -> (N, C, H, W) float32 tensor in [0, 1];
    (N, K, H, W, C) -> (N, K, C, H, W).

    uint8 pixels are divided by 255 in float32, which rounds each of the 256 values to the float32 nearest to
    its exact quotient, as dividing in float64 and rounding to float32 does (a test checks every value)."""
    if images.dtype == np.uint8:
        images = np.divide(images, np.float32(255), dtype=np.float32)
    channels_first = (0, 3, 1, 2) if images.ndim == 4 else (0, 1, 4, 2, 3)
    return torch.as_tensor(images, dtype=torch.float32).permute(*channels_first).contiguous()


def _images(dataset: ArrayDataset, indices: np.ndarray) -> Columns:
    """``pixel_values`` (B, C, H, W); for samples of several images (B, K, C, H, W) and ``image_counts`` (B,)."""
    if dataset.images is None:
        return {}
    columns = {"pixel_values": image_tensor(dataset.images[indices])}
    if dataset.image_counts is not None:
        columns["image_counts"] = torch.as_tensor(dataset.image_counts[indices], dtype=torch.int64)
    return columns


def valid_images(pixels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The (B, K, C, H, W) images of samples with ``counts`` (B,) images each -> (sum of counts, C, H, W), sample by
    sample, without the zero images that pad a sample to K."""
    return pixels[torch.arange(pixels.shape[1], device=pixels.device) < counts.to(pixels.device)[:, None]]


def _inputs(dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
    """The images (``pixel_values``) and input text (``input_ids``, ``attention_mask``) a backbone reads."""
    columns = _images(dataset, indices)
    if dataset.text is not None and "text" in backbone.modalities:
        columns["input_ids"], columns["attention_mask"] = tokenize(prompts(dataset, indices, backbone), backbone)
    return columns


def _check_inputs(dataset: ArrayDataset, backbone: Backbone, kind: str, where: str) -> None:
    """The backbone must read the dataset's inputs: images, text or both."""
    needs = {name for name, column in (("image", dataset.images), ("text", dataset.text)) if column is not None}
    if not needs:
        raise ConfigError(f"{where}.kind = {kind!r} needs inputs, but {where}.source has no images and no input text.")
    _check_images_per_sample(dataset, backbone, where)
    missing = needs - backbone.modalities
    if missing:
        words = {"image": "images", "text": "text"}
        reads, lacks = (" and ".join(words[m] for m in sorted(ms)) for ms in (backbone.modalities, missing))
        raise ConfigError(
            f"{backbone.config_field} = {backbone.name!r} reads {reads} only and cannot run {where}.kind = {kind!r} on the "
            f"{lacks} of {where}.source; use a backbone that reads {' and '.join(words[m] for m in sorted(needs))} "
            f"(e.g. tiny-pretrained:vilt, tiny-pretrained:flava"
            f"{', tiny-pretrained:llama-small' if needs == {'text'} else ', tiny-pretrained:llava'})."
        )


def _check_images_per_sample(dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
    """Samples of several images need a backbone that reads them as image tokens in its prompt (LLaVA)."""
    if dataset.image_counts is not None and not backbone.image_prompt:
        raise ConfigError(
            f"{backbone.config_field} = {backbone.name!r} reads one image a sample, but {where}.image_column holds up to "
            f"{dataset.images.shape[1]} images a sample; use a backbone that reads several (LLaVA: tiny-pretrained:llava "
            "or an hf: LLaVA checkpoint) or an image column of one image a sample."
        )


def _require(dataset: ArrayDataset, column: str, kind: str, where: str, what: str) -> None:
    if getattr(dataset, column) is None:
        raise ConfigError(f"{where}.kind = {kind!r} needs {what}, which {where}.source does not have.")


# Classification --------------------------------------------------------------------------------------
@register_task_kind("classification")
class Classification(TaskKind):
    """Images, text or both -> one of the task's classes (cross-entropy)."""

    name = "classification"
    metrics = ("acc", "loss")
    primary = "acc"
    shared_metrics = ("acc",)

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        _require(dataset, "labels", self.name, where, "class labels")

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        _check_inputs(dataset, backbone, self.name, where)

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        columns = _inputs(dataset, indices, backbone)
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
        _require(dataset, "choices", self.name, where, "the options of each question (data.choices_column)")
        _require(dataset, "labels", self.name, where, "the index of each question's right option")

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        return {"class_names": dataset.class_names, "num_choices": dataset.choices.shape[1]}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        columns = _images(dataset, indices)
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


# Text generation -------------------------------------------------------------------------------------
GENERATION_LENGTH = "generation_length"  # a merged test set's column: each row's own max_new_tokens
# A text-generation batch's text columns: (their padding value, None: the pad token; padded on the left).
_TEXT_PADDING: dict[str, tuple[int | None, bool]] = {
    "input_ids": (None, False), "attention_mask": (0, False), "labels": (IGNORE, False),
    "prompt_ids": (None, True), "prompt_mask": (0, True), "target_ids": (None, False),
}


@register_task_kind("text_generation")
class TextGeneration(TaskKind):
    """A prompt (and an image) -> the target text: next-token cross-entropy on the target's tokens."""

    name = "text_generation"
    forward_inputs = ("input_ids", "attention_mask", "pixel_values", "image_counts")
    metrics = ("token_f1", "exact_match", "meteor", "perplexity")
    primary = "token_f1"
    shared_metrics = ("token_f1",)
    lower_is_better = frozenset({"loss", "perplexity"})

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        _require(dataset, "target", self.name, where, "target text (data.target_column)")

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        _check_images_per_sample(dataset, backbone, where)
        if dataset.images is not None and "image" not in backbone.modalities:
            raise ConfigError(
                f"{backbone.config_field} = {backbone.name!r} reads text only and cannot run {where}.kind = "
                f"{self.name!r} on the images of {where}.source; use an image-text LLM such as tiny-pretrained:llava."
            )

    def check_model(self, model: TaskModel, backbone: Backbone, where: str) -> None:
        if not model.generates_text:
            raise ConfigError(
                f"{backbone.config_field} = {backbone.name!r} does not generate text, so it cannot run {where}.kind = "
                f"{self.name!r}; use a causal LM such as tiny-pretrained:llama-small, tiny-pretrained:qwen or "
                "tiny-pretrained:llava (or a method whose model adds a text decoder)."
            )

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        return {}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        prompt_ids_of = prompt_tokens(prompts(dataset, indices, backbone), backbone)
        target_ids_of = target_tokens([str(t) for t in dataset.target[indices]], backbone)
        longest_target = max(len(t) for t in target_ids_of)
        length = text_width(backbone, max(map(len, prompt_ids_of)) + longest_target)
        pad = backbone.tokenizer.pad_token_id
        rows = len(prompt_ids_of)
        input_ids = torch.full((rows, length), pad, dtype=torch.long)
        attention_mask = torch.zeros((rows, length), dtype=torch.long)
        labels = torch.full((rows, length), IGNORE, dtype=torch.long)
        prompt_length = length - longest_target
        prompt_ids = torch.full((rows, prompt_length), pad, dtype=torch.long)
        target_ids = torch.full((rows, longest_target), pad, dtype=torch.long)
        for row, (prompt, target) in enumerate(zip(prompt_ids_of, target_ids_of)):
            if len(prompt) > prompt_length:
                raise ConfigError(too_long(backbone, len(prompt), longest_target))
            sequence = prompt + target
            input_ids[row, :len(sequence)] = torch.as_tensor(sequence)
            attention_mask[row, :len(sequence)] = 1
            labels[row, len(prompt):len(sequence)] = torch.as_tensor(target)
            prompt_ids[row, prompt_length - len(prompt):] = torch.as_tensor(prompt)  # left-padded, for generation
            target_ids[row, :len(target)] = torch.as_tensor(target)
        prompt_mask = torch.zeros_like(prompt_ids)
        for row, prompt in enumerate(prompt_ids_of):
            prompt_mask[row, prompt_length - len(prompt):] = 1
        return {**_images(dataset, indices), "input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "target_ids": target_ids}

    def forward(self, model: TaskModel, batch: Batch) -> torch.Tensor:
        return model.lm_logits({k: batch[k] for k in self.forward_inputs if k in batch})

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return nn.functional.cross_entropy(outputs[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                           ignore_index=IGNORE)

    def score(self, model: TaskModel, batch: Batch) -> dict[str, float]:
        return {name: float(values.sum()) for name, values in self.score_rows(model, batch).items()}

    def score_rows(self, model: TaskModel, batch: Batch) -> dict[str, torch.Tensor]:
        logits, generated = model.logits_and_generations(batch, max_new_tokens=batch["target_ids"].shape[1])
        logits = logits.float()
        targets = batch["labels"][:, 1:]
        nll = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, ignore_index=IGNORE,
                                          reduction="none").sum(dim=1).detach()
        generated = generated.tolist()
        if GENERATION_LENGTH in batch:  # a merged set: each row generates as many tokens as its own task allows
            generated = [row[:length] for row, length in zip(generated, batch[GENERATION_LENGTH].tolist())]
        tokenizer = model.tokenizer
        predictions = tokenizer.batch_decode(generated, skip_special_tokens=True)
        references = tokenizer.batch_decode(batch["target_ids"], skip_special_tokens=True)
        pairs = list(zip(predictions, references))
        rows = {
            "nll": nll, "tokens": (targets != IGNORE).sum(dim=1),
            "token_f1": [text_metrics.token_f1(p, r) for p, r in pairs],
            "exact_match": [text_metrics.exact_match(p, r) for p, r in pairs],
            "meteor": [text_metrics.meteor(p, r) for p, r in pairs],
        }
        full_meteor = [text_metrics.nltk_meteor(p, r) for p, r in pairs]
        if all(score is not None for score in full_meteor):
            rows["nltk_meteor"] = full_meteor
        bertscore = text_metrics.bertscore_f1(predictions, references)
        if bertscore is not None:
            rows["bertscore_f1"] = bertscore
        return {name: torch.as_tensor(values, dtype=torch.float64).cpu() for name, values in rows.items()}

    def merge_columns(self, columns: Sequence[Columns], pad_token_id: int | None) -> Columns | None:
        """Prompts left-padded and the other text columns right-padded to the longest; each row keeps its own
        task's generation length (``max_new_tokens`` is the width of its task's ``target_ids``)."""
        if pad_token_id is None or not _TEXT_PADDING.keys() <= columns[0].keys() or any(
                c.keys() != columns[0].keys() for c in columns):
            return None
        others = [name for name in columns[0] if name not in _TEXT_PADDING]
        if any(c[name].shape[1:] != columns[0][name].shape[1:] for c in columns for name in others):
            return None
        merged = {name: torch.cat([c[name] for c in columns]) for name in others}
        for name, (fill, left) in _TEXT_PADDING.items():
            width = max(c[name].shape[1] for c in columns)
            padded = []
            for c in columns:
                value = c[name]
                pad = value.new_full((len(value), width - value.shape[1]), pad_token_id if fill is None else fill)
                padded.append(torch.cat([pad, value] if left else [value, pad], dim=1))
            merged[name] = torch.cat(padded)
        merged[GENERATION_LENGTH] = torch.cat([torch.full((len(c["target_ids"]),), c["target_ids"].shape[1])
                                               for c in columns])
        return merged

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        metrics = {name: sums[name] / count for name in ("token_f1", "exact_match", "meteor")}
        metrics["perplexity"] = math.exp(sums["nll"] / max(sums["tokens"], 1.0))
        metrics.update({name: sums[name] / count for name in ("nltk_meteor", "bertscore_f1") if name in sums})
        return metrics


def causal_from_target_logits(target_logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Logits that predict the target tokens at their own positions (batch, target tokens, vocabulary; a
    parallel decoder's) placed where a causal LM predicts them: position p holds the prediction of
    ``input_ids[p + 1]``, so :meth:`TextGeneration.loss` and ``score`` take either model's outputs."""
    targets = batch["labels"] != IGNORE
    # Position p - 1 predicts the target token at p (a target at p = 0 is predicted at the last position); the
    # target token at p is its row's target number rank[p].
    predicts = targets.roll(-1, dims=1)
    rank = (targets.cumsum(dim=1) - 1).clamp(min=0).roll(-1, dims=1)
    placed = target_logits.gather(1, rank.unsqueeze(-1).expand(-1, -1, target_logits.shape[-1]))
    return placed.masked_fill(~predicts.unsqueeze(-1), 0)


@torch.no_grad()
def generate(model: TaskModel, batch: Batch, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuations (batch, new tokens) of the left-padded ``prompt_ids`` by the model's
    ``encoder.generate``, stopping at end-of-text: :meth:`rayfed.TrainableModule.generate_text`'s default."""
    tokenizer = model.tokenizer
    inputs = {"input_ids": batch["prompt_ids"], "attention_mask": batch["prompt_mask"]}
    if "pixel_values" in batch:
        pixels = batch["pixel_values"]
        inputs["pixel_values"] = model.pixels(pixels if pixels.ndim == 4 else valid_images(pixels, batch["image_counts"]))
    output = model.encoder.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=text_end_id(tokenizer, model.chat_template),
    )
    return output[:, batch["prompt_ids"].shape[1]:]


# Reconstruction --------------------------------------------------------------------------------------
@register_task_kind("reconstruction")
class Reconstruction(TaskKind):
    """An image -> the same image (raw [0, 1] pixels), through a decoder head: mean squared error."""

    name = "reconstruction"
    metrics = ("mse",)
    primary = "mse"
    shared_metrics = ("mse",)
    lower_is_better = frozenset({"loss", "mse"})

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        _require(dataset, "images", self.name, where, "images")
        if dataset.image_counts is not None:
            raise ConfigError(f"{where}.kind = {self.name!r} rebuilds one image a sample, but {where}.source has samples "
                              f"of up to {dataset.images.shape[1]} images; use a column of one image a sample.")

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        if "image" not in backbone.modalities:
            raise ConfigError(f"{backbone.config_field} = {backbone.name!r} reads no images and cannot run {where}.kind = "
                              f"{self.name!r}; use an image backbone.")

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        _, height, width, channels = dataset.images.shape
        return {"image_shape": (channels, height, width)}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        return _images(dataset, indices)

    def build_head(self, backbone: Backbone, task: HeadTask) -> nn.Module:
        return ImageDecoder(backbone.feature_dim, task.image_shape)

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.float(), batch.get("target_pixels", batch["pixel_values"]))

    def score(self, model: TaskModel, batch: Batch) -> dict[str, float]:
        outputs = model(batch).float()
        target = batch.get("target_pixels", batch["pixel_values"])
        return {"mse": ((outputs - target) ** 2).flatten(1).mean(dim=1).sum().item()}

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        return {"mse": sums["mse"] / count}


def infer_kind(dataset: ArrayDataset) -> str:
    """The kind a dataset's columns call for: options -> multiple_choice, labels -> classification, target
    text -> text_generation, images alone -> reconstruction."""
    if dataset.choices is not None:
        return "multiple_choice"
    if dataset.labels is not None:
        return "classification"
    if dataset.target is not None:
        return "text_generation"
    return "reconstruction"
