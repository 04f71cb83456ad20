"""The built-in ``text_generation`` kind: a prompt (and an image) -> the target text; with the greedy decoding a
client model runs by default (:func:`generate`) and a parallel decoder's logits placed as a causal LM's
(:func:`causal_from_target_logits`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rayfed.tasks import text_metrics
from rayfed.tasks.kind_base import (
    IGNORE, TaskKind, check_images_per_sample, image_columns, require_column, valid_images,
)
from rayfed.tasks.texts import prompt_tokens, prompts, target_tokens, text_end_id, text_width, too_long
from rayfed.data.batches import Columns
from rayfed.errors import ConfigError
from rayfed.registry import register_task_kind
from rayfed.types import Batch

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset
    from rayfed.tasks.kind_protocols import TaskModel
    from rayfed.models.backbone import Backbone

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
        require_column(dataset, "target", self.name, where, "target text (data.target_column)")

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        check_images_per_sample(dataset, backbone, where)
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
        return {**image_columns(dataset, indices), "input_ids": input_ids, "attention_mask": attention_mask,
                "labels": labels, "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "target_ids": target_ids}

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
    ``encoder.generate``, stopping at end-of-text: :meth:`rayfed.TrainableModule.generate_text`'s default. The whole
    batch decodes in one call with a KV cache (each step after the prompt's feeds the new token alone), whatever a
    checkpoint's ``generation_config.use_cache`` says."""
    tokenizer = model.tokenizer
    inputs = {"input_ids": batch["prompt_ids"], "attention_mask": batch["prompt_mask"]}
    if "pixel_values" in batch:
        pixels = batch["pixel_values"]
        pixels = pixels if pixels.ndim == 4 else valid_images(pixels, batch["image_counts"])
        inputs["pixel_values"] = model.pixels(pixels)
    output = model.encoder.generate(
        **inputs, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=text_end_id(tokenizer, model.chat_template),
    )
    return output[:, batch["prompt_ids"].shape[1]:]
