"""A frozen pretrained model and what the engine needs to use it; building the one ``model.backbone`` names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rayfed.config import ModelConfig
from rayfed.errors import ConfigError
from rayfed.models.features import output_features
from rayfed.registry import resolve
from rayfed.types import Batch

IMAGE, TEXT = "image", "text"


@dataclass
class Backbone:
    """A frozen pretrained model and what the engine needs to use it.

    ``features(encoder, inputs)`` gives (batch, ``feature_dim``) features of a batch whose ``pixel_values``
    are already resized and normalized; ``lm_logits`` (causal LMs only) next-token logits. Images arrive as
    raw [0, 1] pixels and are resized to ``image_size`` and normalized with ``image_mean``/``image_std`` by
    the client model; texts are tokenized by ``tokenizer``, after ``image_prompt`` (LLaVA's image tokens) where
    there is an image (at the text's ``image_placeholder`` if it has one), wrapped in the tokenizer's chat template
    where ``chat_template`` (``model.chat_template``). A set of texts is padded to ``max_text_length`` tokens where
    that is set (``data.max_text_length`` sets it), else to its longest text rounded up to 64, at most
    ``text_limit`` (the model's own limit, image tokens included; :mod:`rayfed.tasks.texts`).
    """

    encoder: nn.Module
    feature_dim: int
    image_size: int | None = None
    num_channels: int = 3
    features: Callable[[nn.Module, Batch], torch.Tensor] = output_features
    modalities: frozenset[str] = frozenset({IMAGE})
    lm_logits: Callable[[nn.Module, Batch], torch.Tensor] | None = None
    tokenizer: Any = None
    max_text_length: int | None = None
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    lora_scope: str | None = None  # the submodule LoRA goes in (LLaVA: its language model), None: anywhere
    image_mean: float | tuple[float, ...] = 0.5
    image_std: float | tuple[float, ...] = 0.5
    image_prompt: str = ""
    image_placeholder: str = ""  # the token by which a text marks where an image goes (LLaVA's "<image>")
    text_limit: int = 32
    chat_template: bool = False
    name: str = field(default="", compare=False)
    config_field: str = field(default="model.backbone", compare=False)  # the config field naming it, for errors

    @property
    def generates_text(self) -> bool:
        return self.lm_logits is not None


@dataclass(frozen=True)
class BackboneRequest:
    """What a backbone builder is asked for: the model config, the seed of random weights, a prefix builder's
    argument (``B`` for ``vit:B``), and ``device``: where a builder that draws random weights may draw them (an
    actor's GPU; ``meta``: shapes only), None for the CPU; a builder that loads weights loads them on the CPU."""

    config: ModelConfig
    seed: int
    argument: str | None = None
    name: str = ""
    device: torch.device | None = None


def build_backbone(config: ModelConfig, seed: int, device: torch.device | str | None = None) -> Backbone:
    """Build (or load) the backbone ``model.backbone`` names; random parts seeded by ``seed``; frozen. ``device``:
    see :class:`BackboneRequest` (the encoder may come back there or on the CPU)."""
    resolved = resolve("backbone", config.backbone)
    torch.manual_seed(seed)
    device = None if device is None else torch.device(device)
    built = resolved.obj(BackboneRequest(config, seed, resolved.argument, resolved.name, device))
    if isinstance(built, nn.Module):
        raise ConfigError(
            f"model.backbone = {resolved.name!r} returned a bare {type(built).__name__}; a backbone builder returns "
            "rayfed.models.Backbone(encoder=..., feature_dim=..., image_size=...)."
        )
    if not isinstance(built, Backbone):
        raise ConfigError(f"model.backbone = {resolved.name!r} returned a {type(built).__name__}, not a Backbone.")
    built.name = built.name or resolved.name
    built.chat_template = _uses_chat_template(config, built)
    built.encoder.requires_grad_(False)
    built.encoder.eval()
    return built


def _uses_chat_template(config: ModelConfig, backbone: Backbone) -> bool:
    """``model.chat_template``, unset: whether the backbone generates text and its tokenizer has a chat template."""
    has_template = bool(getattr(backbone.tokenizer, "chat_template", None))
    if config.chat_template and not has_template:
        raise ConfigError(
            f"model.chat_template = true, but the tokenizer of model.backbone = {backbone.name!r} has no chat "
            "template; set model.chat_template to false or leave it unset for the raw prompts."
        )
    return has_template and backbone.generates_text if config.chat_template is None else config.chat_template
