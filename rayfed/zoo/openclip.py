"""open_clip's ``CLIP``: built-in architectures with pretrained tags, files or ``local-dir:``/``hf-hub:`` folders.

The tiny pretrained model stands in for ``open_clip`` ViT-B-16 (``pretrained="openai"``): the same contrastive
objective (open_clip's ``ClipLoss``) on captions of the seen shape classes, with open_clip's own BPE tokenizer (its
vocabulary ships in the wheel). It is saved like a hub model, ``open_clip_config.json`` +
``open_clip_model.safetensors``, and loaded through ``open_clip.create_model_and_transforms("local-dir:<folder>")``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from rayfed.data.multimodal import CLASSES, PRETRAIN, Distribution
from rayfed.lazy import DeferredModule
from rayfed.zoo import training
from rayfed.zoo.registry import BuildReport, Metrics, ZooModel

open_clip = DeferredModule("open_clip")

RECIPE: dict[str, Any] = {
    "version": 1,
    "seed": 0,
    "model": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 2},
    },
    "train": {"steps": 300, "batch_size": 64, "lr": 1e-3, "weight_decay": 0.1},
    "data": {"train_samples": 4096, "eval_samples": 1024},
}
# An offline backbone at ViT-B/16's depth, 12 blocks per tower, so layer choices made for the real model (such as
# the first adapted layer, l = 10 or l = 5) carry over, and pretraining sees all 64 classes (as real CLIP has
# seen the novel concepts) in every render style but "noisy"; federated fine-tuning then runs on the
# held-out "noisy" style (hue jitter and pixel noise).
DEEP_RECIPE: dict[str, Any] = {
    "version": 1,
    "seed": 0,
    "model": {
        "embed_dim": 64,
        "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 12, "head_width": 16},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 4, "layers": 12},
    },
    "train": {"steps": 800, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.1},
    "data": {"train_samples": 8192, "eval_samples": 1024, "classes": "all",
             "styles": ["plain", "gradient", "textured", "sketch"]},
}
CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"


def load(arch: str, pretrained: str | None = None) -> ZooModel:
    """``open_clip.create_model_and_transforms(arch, pretrained=...)`` and the matching tokenizer.

    ``arch`` is a built-in name (``"ViT-B-16"``, with ``pretrained`` a tag such as ``"openai"`` or a
    checkpoint file) or ``"local-dir:<folder>"`` / ``"hf-hub:<repo>"`` (config and weights together).
    The processor is open_clip's evaluation image transform (PIL image -> tensor). The activation follows the
    tag (:func:`pretrained_options`).
    """
    model, _, preprocess = open_clip.create_model_and_transforms(arch, pretrained=pretrained,
                                                                 **pretrained_options(arch, pretrained))
    return ZooModel(model.eval(), open_clip.get_tokenizer(arch), preprocess)


def pretrained_options(arch: str, pretrained: str | None) -> dict[str, Any]:
    """What open_clip's factory is told besides ``arch`` and ``pretrained``, from open_clip's own record of the tag:
    QuickGELU where the tag's weights were trained with it (OpenAI's), which the factory would only warn about and
    then run with ``arch``'s plain GELU. Nothing for a weights file or a tag open_clip does not know."""
    if pretrained is None:
        return {}
    return {"force_quick_gelu": True} if open_clip.get_pretrained_cfg(arch, pretrained).get("quick_gelu") else {}


def load_folder(path: str) -> ZooModel:
    """A folder written by :func:`build` (the ``local-dir:`` layout of open_clip)."""
    return load(f"local-dir:{path}")


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    model_cfg, data = recipe["model"], recipe["data"]
    model = open_clip.CLIP(**model_cfg)
    tokenizer = open_clip.get_tokenizer("ViT-B-16", context_length=model_cfg["text_cfg"]["context_length"])
    before = _metrics(model, tokenizer, recipe)

    pairs = training.image_text_pairs(data["train_samples"], seed=recipe["seed"], distribution=_pretraining(data))
    images, tokens = training.pixels(pairs["image"]), tokenizer(list(pairs["text"]))
    clip_loss = open_clip.ClipLoss()

    def contrastive_loss(batch: torch.Tensor) -> torch.Tensor:
        image_features, text_features, logit_scale = model(images[batch], tokens[batch])
        return clip_loss(image_features, text_features, logit_scale)

    # The BPE table has 49408 rows and the captions use a few dozen: sparse gradients skip the rest.
    model.token_embedding.sparse = True
    training.train(model, contrastive_loss, num_samples=len(images), seed=recipe["seed"], **recipe["train"])
    model.token_embedding.sparse = False
    preprocess = {"size": model_cfg["vision_cfg"]["image_size"], "mean": [0.5] * 3, "std": [0.5] * 3}
    (out_dir / CONFIG_FILE).write_text(json.dumps({"model_cfg": model_cfg, "preprocess_cfg": preprocess}, indent=2))
    safetensors.torch.save_model(model, str(out_dir / WEIGHTS_FILE))
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def _pretraining(data: Mapping[str, Any]) -> Distribution:
    """The recipe's pretraining images: the seen classes in the pretraining styles unless it names others."""
    if "classes" not in data:
        return PRETRAIN
    classes = CLASSES if data["classes"] == "all" else PRETRAIN.classes
    return Distribution(classes, tuple(data["styles"]), PRETRAIN.tasks)


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    loaded = load_folder(str(path))
    return _metrics(loaded.model, loaded.tokenizer, recipe)


@torch.no_grad()
def _metrics(model: open_clip.CLIP, tokenizer: Any, recipe: Mapping[str, Any]) -> Metrics:
    """Zero-shot accuracies (:func:`rayfed.zoo.training.zero_shot_metrics`)."""
    model.eval()
    return training.zero_shot_metrics(
        model.encode_image, lambda prompts: model.encode_text(tokenizer(prompts)),
        recipe["data"]["eval_samples"], recipe["seed"],
    )  # fmt: skip
