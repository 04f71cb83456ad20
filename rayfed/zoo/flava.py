"""FLAVA in HF transformers (``facebook/flava-full``): image, text and multimodal encoders,
pretrained with ``FlavaForPreTraining``'s own losses: global image-text contrastive, multimodal masked
language modelling and image-text matching.

Masked image modelling is left out: its targets come from a DALL-E image codebook, which would need
pretraining of its own. The folder holds the ``FlavaForPreTraining``; :func:`load` takes its
``FlavaModel``.
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
        "multimodal_layers": 2, "projection_dim": 64, "image_size": 32, "patch_size": 8, "max_text_length": 16,
    },
    "train": {"steps": 600, "batch_size": 64, "lr": 2e-3, "weight_decay": 0.01},
    "data": {"train_samples": 4096, "eval_samples": 512, "mask_probability": 0.3},
}  # fmt: skip


def tiny_config(model: Mapping[str, Any], tokenizer: transformers.PreTrainedTokenizerBase) -> transformers.FlavaConfig:
    sizes = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    encoder = {key: model[key] for key in sizes}
    encoder.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.FlavaConfig(
        # vocab_size: the image codebook's, for the masked-image heads, unused here
        image_config=dict(encoder, image_size=model["image_size"], patch_size=model["patch_size"], vocab_size=16),
        text_config=dict(
            encoder, vocab_size=len(tokenizer), max_position_embeddings=model["max_text_length"],
            pad_token_id=tokenizer.pad_token_id,
        ),
        multimodal_config=dict(encoder, num_hidden_layers=model["multimodal_layers"]),
        projection_dim=model["projection_dim"], hidden_size=model["hidden_size"],
        init_codebook=False, mim_weight=0.0, mmm_image_weight=0.0, mlm_weight=0.0,
    )  # fmt: skip


def load(name_or_path: str) -> ZooModel:
    """``FlavaModel`` (float32) and its tokenizer from a hub name or a local folder."""
    model = transformers.FlavaModel.from_pretrained(name_or_path, dtype=torch.float32)
    return ZooModel(model, load_tokenizer(name_or_path))


def _no_image_masking(batch_size: int, model: transformers.FlavaForPreTraining) -> dict[str, torch.Tensor]:
    # FlavaForPreTraining asks for masked-image labels whenever it sees images; with the image losses
    # weighted 0, no masked patch and labels that ignore every patch satisfy it.
    patches = (model.config.image_config.image_size // model.config.image_config.patch_size) ** 2
    return {
        "bool_masked_pos": torch.zeros(batch_size, patches, dtype=torch.bool),
        "mim_labels": torch.full((batch_size, patches), model.config.ce_ignore_index),
    }


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    data, length = recipe["data"], recipe["model"]["max_text_length"]
    tokenizer = word_tokenizer(append_eos=True, model_max_length=length)
    model = transformers.FlavaForPreTraining(tiny_config(recipe["model"], tokenizer))
    before = _metrics(model, tokenizer, recipe)

    pairs = training.image_text_pairs(data["train_samples"], seed=recipe["seed"], distribution=PRETRAIN)
    images = training.pixels(pairs["image"])
    input_ids, attention_mask = training.encode(tokenizer, pairs["text"], length)
    class_ids = torch.as_tensor(pairs["label"])

    def flava_loss(batch: torch.Tensor) -> torch.Tensor:
        partner, matched = training.matching_pairs(class_ids[batch])
        ids, mask = input_ids[batch][partner], attention_mask[batch][partner]
        masked_ids, labels = training.random_mask(ids, tokenizer.mask_token_id, data["mask_probability"])
        return model(
            input_ids=ids, input_ids_masked=masked_ids, attention_mask=mask, pixel_values=images[batch],
            mlm_labels=labels, itm_labels=matched, return_loss=True, **_no_image_masking(len(batch), model),
        ).loss  # fmt: skip

    training.train(model, flava_loss, num_samples=len(images), seed=recipe["seed"], **recipe["train"])
    training.save_float16(model, out_dir)
    image_size = recipe["model"]["image_size"]
    image_processor = transformers.FlavaImageProcessor(
        size={"height": image_size, "width": image_size}, crop_size={"height": image_size, "width": image_size},
        image_mean=[0.5] * 3, image_std=[0.5] * 3,
    )  # fmt: skip
    transformers.FlavaProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out_dir)
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    model = transformers.FlavaForPreTraining.from_pretrained(path, dtype=torch.float32)
    return _metrics(model, load_tokenizer(path), recipe)


@torch.no_grad()
def _metrics(model: transformers.FlavaForPreTraining, tokenizer: Any, recipe: Mapping[str, Any]) -> Metrics:
    """``mmm_acc``: the masked colour (or shape) word of held-out captions through the multimodal encoder;
    ``itm_acc``: matching vs mismatched image-caption pairs (half each); ``zeroshot_acc`` etc. as for CLIP."""
    model.eval()
    n, seed, length = recipe["data"]["eval_samples"], recipe["seed"], recipe["model"]["max_text_length"]
    data = training.held_out(PRETRAIN, n, seed)
    images = training.pixels(data["image"])
    input_ids, attention_mask = training.encode(tokenizer, data["text"], length)
    masked_ids, labels = training.attribute_mask(input_ids, tokenizer)
    partner, matched = training.matching_pairs(torch.as_tensor(data["label"]))
    correct_words = correct_matches = 0
    for rows in training.batched(n, 256):
        words = model(
            input_ids=input_ids[rows], input_ids_masked=masked_ids[rows], attention_mask=attention_mask[rows],
            pixel_values=images[rows], mlm_labels=labels[rows], itm_labels=torch.ones_like(matched[rows]),
            **_no_image_masking(len(masked_ids[rows]), model),
        )  # fmt: skip
        chosen = labels[rows] != -100
        correct_words += int((words.mmm_text_logits.argmax(-1) == labels[rows][chosen]).sum())
        pair_ids, pair_mask = input_ids[partner[rows]], attention_mask[partner[rows]]
        pairs = model(
            input_ids=pair_ids, input_ids_masked=pair_ids, attention_mask=pair_mask, pixel_values=images[rows],
            **_no_image_masking(len(masked_ids[rows]), model),
        )  # fmt: skip
        correct_matches += int((pairs.itm_logits.argmax(-1) == matched[rows]).sum())

    def encode_images(pixels: torch.Tensor) -> torch.Tensor:
        return model.flava.get_image_features(pixel_values=pixels).pooler_output[:, 0]

    def encode_prompts(prompts: list[str]) -> torch.Tensor:
        ids, mask = training.encode(tokenizer, prompts, length)
        return model.flava.get_text_features(input_ids=ids, attention_mask=mask).pooler_output[:, 0]

    return {
        "mmm_acc": correct_words / int((labels != -100).sum()),
        "itm_acc": correct_matches / n,
        **training.zero_shot_metrics(encode_images, encode_prompts, n, seed),
    }
