"""ViLT: its paper-size configuration, its pretrained loader and its backbone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayfed.lazy import DeferredModule
from rayfed.models.backbone import IMAGE, TEXT, Backbone
from rayfed.models.families.common import PaperModel, _image_normalization, _paper_size, _text_limit, _with_layers
from rayfed.models.features import vilt_features

transformers = DeferredModule("transformers")


def _paper_vilt(size: str, layers: int | None) -> PaperModel:
    from rayfed.zoo import paper

    _paper_size("vilt", size, paper.VILT_SIZES)
    special = paper.BERT_UNCASED.special
    # [CLS] and [SEP]: what a text-less batch reads (vilt_features)
    config = transformers.ViltConfig(**_with_layers(paper.VILT_SIZES[size], layers),
                                     bos_token_id=special["cls_token"][1], eos_token_id=special["sep_token"][1])
    text = paper.tokenizer(paper.BERT_UNCASED, config.max_position_embeddings)
    return PaperModel(config, paper.vilt_processor(text, config.image_size))


def _hf_vilt(name_or_path: str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.ViltModel.from_pretrained(name_or_path, dtype=torch.float32)
    return _vilt(encoder, load_tokenizer(name_or_path), _image_normalization(name_or_path))


def _vilt(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any]) -> Backbone:
    config = encoder.config
    return Backbone(
        encoder, config.hidden_size, config.image_size, config.num_channels, vilt_features,
        frozenset({IMAGE, TEXT}), tokenizer=tokenizer, max_text_length=_text_limit(tokenizer, config.max_position_embeddings),
        lora_targets=("query", "value"), **normalization,
    )  # fmt: skip
