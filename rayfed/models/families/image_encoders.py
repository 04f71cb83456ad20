"""Image encoders: ViT (tiny, the study's sizes, pretrained) and CLIP's vision tower (tiny, pretrained)."""

from __future__ import annotations

from typing import Any

import torch

from rayfed.errors import choice_error
from rayfed.lazy import DeferredModule
from rayfed.models.backbone import Backbone, BackboneRequest
from rayfed.models.features import cls_features, pooler_features
from rayfed.registry import register_backbone

transformers = DeferredModule("transformers")

_TINY_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

# The usual ViT sizes (Ti and S as in DeiT, B and L as in ViT): hidden size, blocks, heads, MLP width.
VIT_SIZES = {
    "T": dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768),
    "S": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536),
    "B": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "L": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def _vit(hf_config: transformers.ViTConfig) -> Backbone:
    encoder = transformers.ViTModel(hf_config, add_pooling_layer=False)
    return Backbone(encoder, hf_config.hidden_size, hf_config.image_size, hf_config.num_channels, cls_features)


@register_backbone("tiny:vit")
def _tiny_vit(request: BackboneRequest) -> Backbone:
    """A tiny random ViT (d 64, 2 blocks, patch 4) at ``model.image_size`` (default 16)."""
    return _vit(transformers.ViTConfig(
        **_TINY_SIZES, image_size=request.config.image_size or 16, patch_size=4, num_channels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))  # fmt: skip


@register_backbone("vit:")
def _sized_vit(request: BackboneRequest) -> Backbone:
    """Randomly initialised ViT-T/S/B/L, patch 16, 224 px (``vit:B``)."""
    if request.argument not in VIT_SIZES:
        raise choice_error("model.backbone", request.name, [f"vit:{s}" for s in VIT_SIZES])
    return _vit(transformers.ViTConfig(**VIT_SIZES[request.argument], image_size=request.config.image_size or 224,
                                       patch_size=16))


@register_backbone("tiny:clip-vision")
def _tiny_clip_vision(request: BackboneRequest) -> Backbone:
    """A tiny random CLIP vision tower (d 64, 2 blocks, patch 4)."""
    clip_config = transformers.CLIPVisionConfig(
        **_TINY_SIZES, image_size=request.config.image_size or 16, patch_size=4, num_channels=3
    )
    encoder = transformers.CLIPVisionModel(clip_config)
    return Backbone(encoder, clip_config.hidden_size, clip_config.image_size, 3, pooler_features)


def _hf_image_encoder(name_or_path: str, hf_config: Any, dtype: torch.dtype | str) -> Backbone:
    if hf_config.model_type == "vit":
        encoder = transformers.ViTModel.from_pretrained(name_or_path, add_pooling_layer=False, dtype=dtype)
        return Backbone(encoder, hf_config.hidden_size, hf_config.image_size, hf_config.num_channels, cls_features)
    vision = hf_config.vision_config if hf_config.model_type == "clip" else hf_config
    encoder = transformers.CLIPVisionModel.from_pretrained(name_or_path, dtype=dtype)
    return Backbone(encoder, vision.hidden_size, vision.image_size, vision.num_channels, pooler_features)
