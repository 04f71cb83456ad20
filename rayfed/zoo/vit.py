"""ViT in HF transformers, pretrained by supervised classification (like ``google/vit-base-patch16-224``)
on the 48 seen shape classes in the pretraining styles.

The folder holds a ``ViTForImageClassification``; :func:`load` (and ``rayfed.models``'
``tiny-pretrained:vit``) takes its encoder as ``ViTModel``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayfed.data.multimodal import PRETRAIN
from rayfed.lazy import DeferredModule
from rayfed.zoo import training
from rayfed.zoo.registry import BuildReport, Metrics, ZooModel

transformers = DeferredModule("transformers")

RECIPE: dict[str, Any] = {
    "version": 2,
    "seed": 0,
    "model": {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "image_size": 32, "patch_size": 8,
    },
    "train": {"steps": 400, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.05},
    "data": {"train_samples": 4096, "eval_samples": 1024},
}  # fmt: skip


def tiny_config(model: Mapping[str, Any]) -> transformers.ViTConfig:
    """A ViT of the sizes in ``model`` with a head over :data:`~rayfed.data.multimodal.PRETRAIN`'s classes."""
    return transformers.ViTConfig(
        **model, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        id2label=dict(enumerate(PRETRAIN.classes)), label2id={name: i for i, name in enumerate(PRETRAIN.classes)},
    )  # fmt: skip


def load(name_or_path: str) -> ZooModel:
    """``ViTModel`` (no pooler: features are the CLS token) in float32 from a hub name or a local folder."""
    return ZooModel(transformers.ViTModel.from_pretrained(name_or_path, add_pooling_layer=False, dtype=torch.float32))


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    data = recipe["data"]
    model = transformers.ViTForImageClassification(tiny_config(recipe["model"]))
    before = _metrics(model, recipe)
    pairs = training.image_text_pairs(data["train_samples"], seed=recipe["seed"], distribution=PRETRAIN)
    images = training.pixels(pairs["image"])
    labels = torch.as_tensor([PRETRAIN.classes.index(name) for name in pairs["class_name"]])

    def classification_loss(batch: torch.Tensor) -> torch.Tensor:
        return model(pixel_values=images[batch], labels=labels[batch]).loss

    training.train(model, classification_loss, num_samples=len(images), seed=recipe["seed"], **recipe["train"])
    training.save_float16(model, out_dir)
    image_size = recipe["model"]["image_size"]
    transformers.ViTImageProcessor(
        size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(out_dir)
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    return _metrics(transformers.ViTForImageClassification.from_pretrained(path, dtype=torch.float32), recipe)


@torch.no_grad()
def _metrics(model: transformers.ViTForImageClassification, recipe: Mapping[str, Any]) -> Metrics:
    """``accuracy``: the pretraining head on held-out images of the seen classes, pretraining styles;
    ``probe_acc``: a linear probe on CLS features (:func:`rayfed.zoo.training.probe_accuracy`)."""
    model.eval()
    n, seed = recipe["data"]["eval_samples"], recipe["seed"]
    data = training.held_out(PRETRAIN, n, seed)
    images = training.pixels(data["image"])
    logits = torch.cat([model(pixel_values=images[rows]).logits for rows in training.batched(n, 256)])
    labels = np.asarray([PRETRAIN.classes.index(name) for name in data["class_name"]])
    encode = lambda images: model.vit(pixel_values=images).last_hidden_state[:, 0]  # noqa: E731
    return {
        "accuracy": float(np.mean(logits.argmax(-1).numpy() == labels)),
        "probe_acc": training.probe_accuracy(encode, n, seed),
    }
