"""Pretrained backbones by hub name or ``save_pretrained`` folder (``hf:``), and the zoo's tiny pretrained ones."""

from __future__ import annotations

import torch

from rayfed.config import ModelConfig
from rayfed.errors import ConfigError, choice_error
from rayfed.lazy import DeferredModule
from rayfed.models.backbone import Backbone, BackboneRequest
from rayfed.models.families.common import _quiet_loading, weights_dtype
from rayfed.models.families.flava import _hf_flava
from rayfed.models.families.image_encoders import _hf_image_encoder
from rayfed.models.families.llava import _hf_llava
from rayfed.models.families.llm import _hf_causal_lm
from rayfed.models.families.vilt import _hf_vilt
from rayfed.registry import register_backbone

transformers = DeferredModule("transformers")


@register_backbone("tiny-pretrained:")
def _tiny_pretrained(request: BackboneRequest) -> Backbone:
    """A tiny model of a zoo family pretrained on synthetic data (docs/offline_models.md), built on first use."""
    from rayfed.zoo import FAMILIES, pretrained

    family = request.argument
    if family not in FAMILIES:
        raise choice_error("model.backbone", request.name, [f"tiny-pretrained:{f}" for f in FAMILIES])
    # float32 everywhere, whatever the stored folder's dtype (float16): the offline numbers are float32's
    return load_hf_backbone(str(pretrained(family)), request.config, shown_as=request.name)


@register_backbone("hf:")
def _hf(request: BackboneRequest) -> Backbone:
    """A transformers model by hub name or save_pretrained folder: ViT, CLIP (vision tower), ViLT, FLAVA,
    LLaVA or any causal LM (Llama, Qwen2, ...); in the dtype it ships in where this process sees a GPU, else
    float32."""
    return load_hf_backbone(request.argument or "", request.config, dtype=weights_dtype("auto"))


def load_hf_backbone(name_or_path: str, config: ModelConfig, shown_as: str | None = None,
                     dtype: torch.dtype | str = torch.float32) -> Backbone:
    """The backbone in a hub name or folder, by its config's ``model_type``, its weights in ``dtype`` (``"auto"``: as
    stored); errors name it as ``shown_as``."""
    with _quiet_loading():
        return _load_hf_backbone(name_or_path, config, shown_as, dtype)


def _load_hf_backbone(name_or_path: str, config: ModelConfig, shown_as: str | None,
                      dtype: torch.dtype | str) -> Backbone:
    shown_as = shown_as or f"hf:{name_or_path}"
    try:
        hf_config = transformers.AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"model.backbone = {shown_as!r} could not be loaded (not a local model folder, "
            f"and the hub is unreachable or has no such model): {str(err).splitlines()[0]}"
        ) from None
    model_type = hf_config.model_type
    if model_type in ("vit", "clip", "clip_vision_model"):
        backbone = _hf_image_encoder(name_or_path, hf_config, dtype)
    elif model_type == "vilt":
        backbone = _hf_vilt(name_or_path, dtype)
    elif model_type == "flava":
        backbone = _hf_flava(name_or_path, dtype)
    elif model_type == "llava":
        backbone = _hf_llava(name_or_path, dtype)
    elif model_type in transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        backbone = _hf_causal_lm(name_or_path, dtype)
    else:
        raise ConfigError(
            f"model.backbone = {shown_as!r} is a {model_type!r} model; allowed are ViT, CLIP (vision tower), "
            "ViLT, FLAVA, LLaVA and causal language models."
        )
    if config.image_size and backbone.image_size and config.image_size != backbone.image_size:
        raise ConfigError(
            f"model.image_size = {config.image_size} does not match the pretrained backbone's "
            f"{backbone.image_size}; leave model.image_size unset for pretrained backbones."
        )
    backbone.name = shown_as
    return backbone
