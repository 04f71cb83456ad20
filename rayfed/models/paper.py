"""Paper-size backbones: the published configurations of rayfed.zoo.paper, randomly initialised."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from rayfed.errors import choice_error
from rayfed.lazy import DeferredModule
from rayfed.models.backbone import Backbone, BackboneRequest
from rayfed.models.families.common import PaperModel, _quiet_loading, weights_dtype
from rayfed.models.families.flava import _flava, _paper_flava
from rayfed.models.families.llava import _llava, _paper_llava
from rayfed.models.families.vilt import _paper_vilt, _vilt
from rayfed.registry import register_backbone

transformers = DeferredModule("transformers")


def paper_model(name: str, layers: int | None = None) -> PaperModel:
    """The configuration and processor of the paper-size backbone ``name`` (``flava:full``, ``vilt:B32``,
    ``llava:llama-1B``, ...; docs/offline_models.md); ``layers``: each transformer stack of it cut to that many
    blocks (the paper's widths at a CPU's depth, for tests)."""
    family, _, size = name.partition(":")
    if family not in _PAPER_FAMILIES:
        raise choice_error("model.backbone", name, [f"{f}:<size>" for f in _PAPER_FAMILIES])
    return _PAPER_FAMILIES[family](size, layers)

_PAPER_FAMILIES: dict[str, Callable[[str, int | None], PaperModel]] = {
    "flava": _paper_flava, "vilt": _paper_vilt, "llava": _paper_llava,
}


def paper_backbone(name: str, layers: int | None = None, device: torch.device | str | None = None) -> Backbone:
    """The paper-size backbone ``name``, randomly initialised (see :func:`paper_model`) on ``device`` (default: the
    default device, usually the CPU, whose threads take minutes over billions of weights; ``meta``: shapes only).
    FLAVA and ViLT in float32, LLaVA as ``llama:`` backbones (bfloat16 where a GPU is seen)."""
    model = paper_model(name, layers)
    config, tokenizer, images = model.config, model.processor.tokenizer, model.processor.image_processor
    normalization = {"image_mean": tuple(images.image_mean), "image_std": tuple(images.image_std)}
    with _quiet_loading(), torch.device(device) if device is not None else contextlib.nullcontext():
        if isinstance(config, transformers.FlavaConfig):
            return _flava(transformers.FlavaModel(config), tokenizer, normalization)
        if isinstance(config, transformers.ViltConfig):
            return _vilt(transformers.ViltModel(config), tokenizer, normalization)
        encoder = transformers.AutoModelForImageTextToText.from_config(config, dtype=weights_dtype(torch.bfloat16))
    return _llava(encoder, tokenizer, normalization)


@register_backbone("flava:")
def _random_flava(request: BackboneRequest) -> Backbone:
    """FLAVA at facebook/flava-full's size (``flava:full``), randomly initialised, offline tokenizer."""
    return paper_backbone(request.name, device=request.device)


@register_backbone("vilt:")
def _random_vilt(request: BackboneRequest) -> Backbone:
    """ViLT at dandelin/vilt-b32-mlm's size (``vilt:B32``), randomly initialised, offline tokenizer."""
    return paper_backbone(request.name, device=request.device)


@register_backbone("llava:")
def _random_llava(request: BackboneRequest) -> Backbone:
    """LLaVA-1.5 (CLIP ViT-L/14-336) on Llama-3.2 or Qwen2.5 (``llava:llama-1B``, ``llava:qwen-0.5B``, ...),
    randomly initialised, offline tokenizer; bfloat16 weights where a GPU is seen."""
    return paper_backbone(request.name, device=request.device)
