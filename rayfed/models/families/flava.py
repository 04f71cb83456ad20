"""FLAVA: its paper-size configuration, its pretrained loader and its backbone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayfed.lazy import DeferredModule
from rayfed.models.backbone import IMAGE, TEXT, Backbone
from rayfed.models.families.common import PaperModel, _image_normalization, _paper_size, _text_limit, _with_layers
from rayfed.models.features import flava_features
from rayfed.models.fused_attention import fuse_self_attention

transformers = DeferredModule("transformers")


def _paper_flava(size: str, layers: int | None) -> PaperModel:
    from rayfed.zoo import paper

    _paper_size("flava", size, paper.FLAVA_SIZES)
    facts = paper.FLAVA_SIZES[size]
    config = transformers.FlavaConfig(**{
        key: _with_layers(value, layers) if key.endswith("_config") else value for key, value in facts.items()
    })
    text = paper.tokenizer(paper.BERT_UNCASED, config.text_config.max_position_embeddings)
    return PaperModel(config, paper.flava_processor(text, config.image_config.image_size))


def _hf_flava(name_or_path: str, dtype: torch.dtype | str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.FlavaModel.from_pretrained(name_or_path, dtype=dtype)
    return _flava(encoder, load_tokenizer(name_or_path), _image_normalization(name_or_path))


def _flava(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any]) -> Backbone:
    config = encoder.config
    fuse_self_attention(encoder)
    return Backbone(
        encoder, config.hidden_size, config.image_config.image_size, config.image_config.num_channels, flava_features,
        frozenset({IMAGE, TEXT}), tokenizer=tokenizer,
        text_limit=_text_limit(tokenizer, config.text_config.max_position_embeddings),
        lora_targets=("query", "value"), **normalization,
    )  # fmt: skip
