"""CLIP in HF transformers (``CLIPModel``) and its vision tower (``CLIPVisionModel``).

Stands in for ``openai/clip-vit-base-patch16`` and similar: pretrained with CLIP's symmetric contrastive
image-text loss on captions of the seen shape classes in the pretraining styles.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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
        "projection_dim": 64, "image_size": 32, "patch_size": 8, "max_text_length": 16,
    },
    "train": {"steps": 400, "batch_size": 64, "lr": 1e-3, "weight_decay": 0.1},
    "data": {"train_samples": 4096, "eval_samples": 1024},
}  # fmt: skip
VISION_RECIPE: dict[str, Any] = {"version": 2, "seed": 0, "data": {"eval_samples": 1024}}


def tiny_config(model: Mapping[str, Any], tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.CLIPConfig:
    """Both towers of the sizes in ``model``; the text tower's special ids are the tokenizer's."""
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    tower = {key: model[key] for key in sizes}
    text = dict(
        tower, vocab_size=len(tokenizer), max_position_embeddings=model["max_text_length"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(tower, image_size=model["image_size"], patch_size=model["patch_size"])
    return transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=model["projection_dim"])


def image_processor(image_size: int) -> transformers.CLIPImageProcessor:
    """Resize and normalize to [-1, 1], as the pretraining did."""
    return transformers.CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip


def load(name_or_path: str) -> ZooModel:
    """``CLIPModel`` (float32) and its tokenizer from a hub name or a local folder."""
    model = transformers.CLIPModel.from_pretrained(name_or_path, dtype=torch.float32)
    return ZooModel(model, load_tokenizer(name_or_path))


def load_vision(name_or_path: str) -> ZooModel:
    """``CLIPVisionModel`` (the image tower alone, float32) from a hub name or a local folder."""
    return ZooModel(transformers.CLIPVisionModel.from_pretrained(name_or_path, dtype=torch.float32))


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    model_recipe, train_recipe, data = recipe["model"], recipe["train"], recipe["data"]
    tokenizer = word_tokenizer(append_eos=True, model_max_length=model_recipe["max_text_length"])
    model = transformers.CLIPModel(tiny_config(model_recipe, tokenizer))
    before = _metrics(model, tokenizer, recipe)

    pairs = training.image_text_pairs(data["train_samples"], seed=recipe["seed"], distribution=PRETRAIN)
    images = training.pixels(pairs["image"])
    input_ids, attention_mask = training.encode(tokenizer, pairs["text"], model_recipe["max_text_length"])

    def contrastive_loss(batch: torch.Tensor) -> torch.Tensor:
        texts = {"input_ids": input_ids[batch], "attention_mask": attention_mask[batch]}
        return model(**texts, pixel_values=images[batch], return_loss=True).loss

    training.train(model, contrastive_loss, num_samples=len(images), seed=recipe["seed"], **train_recipe)
    training.save_float16(model, out_dir)
    processor = image_processor(model_recipe["image_size"])
    transformers.CLIPProcessor(image_processor=processor, tokenizer=tokenizer).save_pretrained(out_dir)
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    loaded = load(str(path))
    return _metrics(loaded.model, loaded.tokenizer, recipe)


@torch.no_grad()
def _metrics(model: transformers.CLIPModel, tokenizer: Any, recipe: Mapping[str, Any]) -> Metrics:
    """Zero-shot accuracies (:func:`rayfed.zoo.training.zero_shot_metrics`)."""
    model.eval()
    length = recipe["model"]["max_text_length"]

    def encode_prompts(prompts: list[str]) -> torch.Tensor:
        input_ids, attention_mask = training.encode(tokenizer, prompts, length)
        return model.get_text_features(input_ids=input_ids, attention_mask=attention_mask).pooler_output

    return training.zero_shot_metrics(
        lambda images: model.get_image_features(pixel_values=images).pooler_output,
        encode_prompts, recipe["data"]["eval_samples"], recipe["seed"],
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The vision tower as its own model folder (what rayfed.models loads as a backbone)


def build_vision(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    clip = transformers.CLIPModel.from_pretrained(dependencies["clip"], dtype=torch.float32)
    pretrained = transformers.CLIPVisionModel(clip.config.vision_config)
    pretrained.load_state_dict(clip.vision_model.state_dict())
    training.save_float16(pretrained, out_dir)
    image_processor(clip.config.vision_config.image_size).save_pretrained(out_dir)
    untrained = transformers.CLIPVisionModel(clip.config.vision_config)
    before = _vision_metrics(untrained, recipe)
    return BuildReport(before, evaluate_vision(out_dir, recipe), training.parameter_count(pretrained))


def evaluate_vision(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    return _vision_metrics(load_vision(str(path)).model, recipe)


@torch.no_grad()
def _vision_metrics(model: transformers.CLIPVisionModel, recipe: Mapping[str, Any]) -> Metrics:
    """``probe_acc``: a linear probe on the pooled features (:func:`rayfed.zoo.training.probe_accuracy`)."""
    model.eval()
    encode = lambda images: model(pixel_values=images).pooler_output  # noqa: E731
    return {"probe_acc": training.probe_accuracy(encode, recipe["data"]["eval_samples"], recipe["seed"])}
