"""A ladder of ViTs of growing size, pretrained on the part-texture upstream task: the offline scale study of
*Augmenting Federated Learning with Pretrained Transformers* (arXiv 2307.04905),
docs/fedyolo.md#offline-results-on-the-scale-ladder.

The zoo families ``vit-ladder-t``, ``-s`` and ``-b`` (``tiny-pretrained:vit-ladder-<size>``). Every size sees the
same images for the same number of steps, so only the size differs. The larger sizes take minutes on a GPU and
hours on a CPU, so their built folders ship with rayfed (``rayfed/zoo/weights``, float16 tensors, loaded as
float32); any other recipe builds on first use, on the GPU when there is one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rayfed.lazy import DeferredModule
from rayfed.methods.fedyolo import parts
from rayfed.zoo import training
from rayfed.zoo.families import register_family
from rayfed.zoo.registry import BuildReport, Family, Metrics, ZooModel

transformers = DeferredModule("transformers")

# d, blocks, heads, MLP width (T', S', B'); 32 px images in 4-px patches (65 tokens).
SIZES: dict[str, dict[str, int]] = {
    "t": {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 3, "intermediate_size": 192},
    "s": {"hidden_size": 96, "num_hidden_layers": 4, "num_attention_heads": 3, "intermediate_size": 384},
    "b": {"hidden_size": 192, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 768},
}


def recipe(size: str) -> dict[str, Any]:
    return {
        "version": 1,
        "seed": 0,
        "model": {**SIZES[size], "image_size": parts.IMAGE_SIZE, "patch_size": 4},
        "train": {"steps": 4000, "batch_size": 256, "lr": 1e-3, "weight_decay": 0.05},
        "data": {"generator_version": parts.VERSION, "world": 0, "train_samples": 100 * parts.UPSTREAM_CLASSES,
                 "eval_samples": 2048},
    }  # fmt: skip


def _config(model: Mapping[str, Any]) -> transformers.ViTConfig:
    return transformers.ViTConfig(
        **model, num_channels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels=parts.UPSTREAM_CLASSES,
    )  # fmt: skip


def _device() -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (deterministic_cpu's flag)
    return torch.device("cuda")


def _pixels(images: np.ndarray) -> torch.Tensor:
    """[0, 1] (N, H, W, C) -> (N, C, H, W) in [-1, 1], as ``rayfed.models.ClientModel.pixels`` gives the backbone."""
    return (torch.from_numpy(images).permute(0, 3, 1, 2) - 0.5) / 0.5


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    device = _device()
    model = transformers.ViTForImageClassification(_config(recipe["model"])).to(device)
    before = _metrics(model, recipe)
    data = recipe["data"]
    images, labels = parts.render(
        data["train_samples"], label_space="upstream", seed=recipe["seed"], world_seed=data["world"]
    )
    pixels = _pixels(images).to(device)
    targets = torch.as_tensor(labels, device=device)

    def classification_loss(batch: torch.Tensor) -> torch.Tensor:
        batch = batch.to(device)
        return model(pixel_values=pixels[batch], labels=targets[batch]).loss

    training.train(model, classification_loss, num_samples=len(labels), seed=recipe["seed"], **recipe["train"])
    training.save_float16(model, out_dir)
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def load(name_or_path: str) -> ZooModel:
    """The encoder (``ViTModel``, CLS features) in float32."""
    return ZooModel(transformers.ViTModel.from_pretrained(name_or_path, add_pooling_layer=False, dtype=torch.float32))


def load_classifier(path: str | Path) -> transformers.ViTForImageClassification:
    return transformers.ViTForImageClassification.from_pretrained(path, dtype=torch.float32)


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    return _metrics(load_classifier(path).to(_device()), recipe)


@torch.no_grad()
def _metrics(model: transformers.ViTForImageClassification, recipe: Mapping[str, Any]) -> Metrics:
    """``accuracy``: upstream classes, held-out images; ``probe_acc``: a linear probe on CLS features for
    the 100 downstream ("fine") classes, which pretraining never saw."""
    model.eval()
    device = next(model.parameters()).device
    n, seed, world = recipe["data"]["eval_samples"], recipe["seed"] + 10_000, recipe["data"]["world"]

    def run(label_space: str, forward: Any) -> tuple[torch.Tensor, np.ndarray]:
        images, labels = parts.render(n, label_space=label_space, seed=seed, world_seed=world)
        pixels = _pixels(images).to(device)
        return torch.cat([forward(pixels[rows]) for rows in training.batched(n, 256)]).cpu(), labels

    logits, labels = run("upstream", lambda x: model(pixel_values=x).logits)
    features, fine_labels = run("fine", lambda x: model.vit(pixel_values=x).last_hidden_state[:, 0])
    return {
        "accuracy": float(np.mean(logits.argmax(-1).numpy() == labels)),
        "probe_acc": training.ridge_probe(features, fine_labels, parts.FINE_CLASSES),
    }


for _size in SIZES:
    register_family(Family(
        f"vit-ladder-{_size}", f"HF ViT at FedYolo's ViT-{_size.upper()} rung of the scale ladder "
        "(docs/fedyolo.md#offline-results-on-the-scale-ladder)",
        "supervised classification of 256 part-texture layouts (rayfed.methods.fedyolo.parts)",
        recipe(_size), build, evaluate, load, needs_gpu=True,
    ))  # fmt: skip
