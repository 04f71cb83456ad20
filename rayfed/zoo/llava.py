"""LLaVA in HF transformers (``LlavaForConditionalGeneration``, like ``llava-hf/llava-1.5-7b-hf``, a
multi-modal LLM): the tiny pretrained CLIP vision tower, a projector and a tiny
pretrained Llama, at two sizes: ``llava`` on ``llama-small`` and ``llava-large`` on ``llama-large``
(clients of different sizes in one federation). As in LLaVA's instruction stage, the projector and the language model
learn image-conditioned next-token prediction (captions after the image tokens) while the vision tower
stays frozen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rayfed.data.multimodal import COLORS, PRETRAIN, SHAPES
from rayfed.lazy import DeferredModule
from rayfed.zoo import clip, training
from rayfed.zoo.causal_lm import sequences
from rayfed.zoo.registry import BuildReport, Metrics, ZooModel
from rayfed.zoo.tokenizers import IMAGE, load_tokenizer

transformers = DeferredModule("transformers")

VISION = "clip-vision"  # the family of the vision tower
# Each LLaVA family: the causal-LM family of its language model.
LANGUAGE_MODELS: dict[str, str] = {"llava": "llama-small", "llava-large": "llama-large"}
RECIPE: dict[str, Any] = {
    "version": 2,
    "seed": 0,
    "model": {"vision_feature_layer": -1, "projector_hidden_act": "gelu"},
    "train": {"steps": 300, "batch_size": 32, "lr": 2e-3, "weight_decay": 0.0},
    "data": {"train_samples": 4096, "eval_samples": 512},
}
# The deeper language model learns with a lower rate, for longer.
RECIPES: dict[str, dict[str, Any]] = {
    "llava": RECIPE,
    "llava-large": {**RECIPE, "train": {**RECIPE["train"], "steps": 500, "lr": 1e-3}},
}


def load(name_or_path: str) -> ZooModel:
    """``LlavaForConditionalGeneration`` (float32) and its processor (which expands ``<image>`` into the
    image tokens)."""
    processor = transformers.AutoProcessor.from_pretrained(name_or_path)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(name_or_path, dtype=torch.float32)
    return ZooModel(model, processor.tokenizer, processor)


def image_token_count(config: transformers.LlavaConfig) -> int:
    """Image tokens per image: one per patch ("default" feature selection drops the CLS token)."""
    return (config.vision_config.image_size // config.vision_config.patch_size) ** 2


def captioning_sequences(
    tokenizer: Any, config: transformers.LlavaConfig, captions: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``<bos> <image>*P caption <eos>``, as the processor writes ``"<image> caption"``; labels only on the caption."""
    count = image_token_count(config)
    texts = [f"{IMAGE * count} {caption}" for caption in captions]
    input_ids, attention_mask, labels = sequences(tokenizer, texts, max_length=count + 16)
    labels[input_ids == config.image_token_id] = -100
    return input_ids, attention_mask, labels


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    data = recipe["data"]
    (language_folder,) = (folder for name, folder in dependencies.items() if name != VISION)
    vision = transformers.CLIPVisionModel.from_pretrained(dependencies[VISION], dtype=torch.float32)
    language = transformers.AutoModelForCausalLM.from_pretrained(language_folder, dtype=torch.float32)
    tokenizer = load_tokenizer(language_folder)
    for tower, folder in ((vision, dependencies[VISION]), (language, language_folder)):
        tower.config.name_or_path = Path(folder).name  # not the absolute path, which would be saved
    config = transformers.LlavaConfig(
        vision_config=vision.config, text_config=language.config, image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
        vision_feature_select_strategy="default", **recipe["model"],
    )  # fmt: skip
    config.image_seq_length = image_token_count(config)
    model = transformers.LlavaForConditionalGeneration(config)
    before = _metrics(model, tokenizer, recipe)

    model.model.vision_tower.load_state_dict(vision.state_dict())
    model.model.language_model.load_state_dict(language.model.state_dict())
    model.lm_head.load_state_dict(language.lm_head.state_dict())
    model.model.vision_tower.requires_grad_(False)

    pairs = training.image_text_pairs(data["train_samples"], seed=recipe["seed"], distribution=PRETRAIN)
    images = training.pixels(pairs["image"])
    input_ids, attention_mask, labels = captioning_sequences(tokenizer, config, list(pairs["text"]))

    def captioning_loss(batch: torch.Tensor) -> torch.Tensor:
        inputs = {"input_ids": input_ids[batch], "attention_mask": attention_mask[batch], "labels": labels[batch]}
        return model(**inputs, pixel_values=images[batch]).loss

    training.train(model, captioning_loss, num_samples=len(images), seed=recipe["seed"], **recipe["train"])
    training.save_float16(model, out_dir)
    transformers.LlavaProcessor(
        image_processor=clip.image_processor(config.vision_config.image_size), tokenizer=tokenizer,
        patch_size=config.vision_config.patch_size, vision_feature_select_strategy="default", image_token=IMAGE,
        num_additional_image_tokens=1,
    ).save_pretrained(out_dir)  # fmt: skip
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    loaded = load(str(path))
    return _metrics(loaded.model, loaded.tokenizer, recipe)


@torch.no_grad()
def _metrics(model: transformers.LlavaForConditionalGeneration, tokenizer: Any, recipe: Mapping[str, Any]) -> Metrics:
    """On held-out captions: ``attribute_acc``, the colour and shape words predicted from the image and the
    words before them; ``caption_perplexity`` over all caption tokens."""
    model.eval()
    n = recipe["data"]["eval_samples"]
    data = training.held_out(PRETRAIN, n, recipe["seed"])
    input_ids, attention_mask, labels = captioning_sequences(tokenizer, model.config, list(data["text"]))
    images = training.pixels(data["image"])
    logits = torch.cat([
        model(input_ids=input_ids[rows], attention_mask=attention_mask[rows], pixel_values=images[rows]).logits[:, :-1]
        for rows in training.batched(n, 128)
    ])  # fmt: skip
    targets = labels[:, 1:]
    predicted = targets != -100
    attributes = torch.isin(targets, torch.as_tensor(tokenizer.convert_tokens_to_ids([*COLORS, *SHAPES])))
    nll = torch.nn.functional.cross_entropy(logits[predicted], targets[predicted])
    return {
        "attribute_acc": float((logits[attributes].argmax(-1) == targets[attributes]).float().mean()),
        "caption_perplexity": math.exp(nll.item()),
    }
