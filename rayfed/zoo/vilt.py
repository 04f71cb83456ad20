"""ViLT in HF transformers: a single-stream image-text transformer (``dandelin/vilt-b32-mlm``),
pretrained with ViLT's objectives, masked language modelling and image-text matching.

The folder holds a ``ViltForMaskedLM`` (the MLM head and the pooler trained by matching);
:func:`load` takes its ``ViltModel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayfed.data.multimodal import PRETRAIN
from rayfed.lazy import DeferredModule
from rayfed.zoo import training
from rayfed.zoo.registry import BuildReport, Metrics, ZooModel
from rayfed.zoo.tokenizers import load_tokenizer, word_tokenizer

transformers = DeferredModule("transformers")

RECIPE: dict[str, Any] = {
    "version": 2,
    "seed": 0,
    "model": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "image_size": 32, "patch_size": 8, "max_text_length": 16,
    },
    "train": {"steps": 300, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.01},
    "data": {"train_samples": 4096, "eval_samples": 1024, "mask_probability": 0.5},
}  # fmt: skip


def tiny_config(model: Mapping[str, Any], tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.ViltConfig:
    sizes = {key: value for key, value in model.items() if key != "max_text_length"}
    return transformers.ViltConfig(
        **sizes, vocab_size=len(tokenizer), max_position_embeddings=model["max_text_length"], num_channels=3,
        max_image_length=-1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip


def load(name_or_path: str) -> ZooModel:
    """``ViltModel`` (float32) and its tokenizer from a hub name or a local folder."""
    model = transformers.ViltModel.from_pretrained(name_or_path, dtype=torch.float32)
    return ZooModel(model, load_tokenizer(name_or_path))


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    data, length = recipe["data"], recipe["model"]["max_text_length"]
    tokenizer = word_tokenizer(append_eos=True, model_max_length=length)
    model = transformers.ViltForMaskedLM(tiny_config(recipe["model"], tokenizer))
    itm_head = nn.Linear(model.config.hidden_size, 2)  # a pretraining head only: not saved
    before = _metrics(model, tokenizer, recipe)

    pairs = training.image_text_pairs(data["train_samples"], seed=recipe["seed"], distribution=PRETRAIN)
    images = training.pixels(pairs["image"])
    input_ids, attention_mask = training.encode(tokenizer, pairs["text"], length)
    class_ids = torch.as_tensor(pairs["label"])

    def mlm_and_itm_loss(batch: torch.Tensor) -> torch.Tensor:
        partner, matched = training.matching_pairs(class_ids[batch])
        ids, mask = input_ids[batch][partner], attention_mask[batch][partner]
        masked_ids, labels = training.random_mask(ids, tokenizer.mask_token_id, data["mask_probability"])
        labels[matched == 0] = -100  # as in ViLT, words are predicted from matching images only
        out = model.vilt(input_ids=masked_ids, attention_mask=mask, pixel_values=images[batch])
        mlm_logits = model.mlm_score(out.last_hidden_state[:, :length])
        mlm_loss = nn.functional.cross_entropy(mlm_logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return mlm_loss + nn.functional.cross_entropy(itm_head(out.pooler_output), matched)

    trainable = nn.ModuleList([model, itm_head])
    training.train(trainable, mlm_and_itm_loss, num_samples=len(images), seed=recipe["seed"], **recipe["train"])
    training.save_float16(model, out_dir)
    image_size = recipe["model"]["image_size"]
    image_processor = transformers.ViltImageProcessor(
        size={"shortest_edge": image_size}, size_divisor=recipe["model"]["patch_size"],
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    transformers.ViltProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    model = transformers.ViltForMaskedLM.from_pretrained(path, dtype=torch.float32)
    return _metrics(model, load_tokenizer(path), recipe)


@torch.no_grad()
def _metrics(model: transformers.ViltForMaskedLM, tokenizer: Any, recipe: Mapping[str, Any]) -> Metrics:
    """``mlm_acc``: the masked colour (or shape) word of held-out captions, predicted from text and image."""
    model.eval()
    n, length = recipe["data"]["eval_samples"], recipe["model"]["max_text_length"]
    data = training.held_out(PRETRAIN, n, recipe["seed"])
    images = training.pixels(data["image"])
    input_ids, attention_mask = training.encode(tokenizer, data["text"], length)
    masked_ids, labels = training.attribute_mask(input_ids, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe["seed"])  # ViLT shuffles its patch tokens with torch.multinomial, even in eval
        logits = torch.cat([
            model(input_ids=masked_ids[rows], attention_mask=attention_mask[rows], pixel_values=images[rows]).logits
            for rows in training.batched(n, 256)
        ])  # fmt: skip
    chosen = labels != -100
    return {"mlm_acc": float((logits[chosen].argmax(-1) == labels[chosen]).float().mean())}
