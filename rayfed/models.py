"""Backbones and client models.

A *backbone* is a frozen feature extractor built once per ClientActor. A *client model* is the
backbone plus what a method trains: LoRA adapters (through peft) and a classification head.
Every parameter of a client model is either trainable (its value lives in client or server
state and is swapped in per client) or frozen (shared by every client the actor hosts).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import peft
import torch
import transformers
from torch import nn

from rayfed.config import LoraConfig, ModelConfig
from rayfed.errors import ConfigError, choice_error
from rayfed.modules import add_adapters, add_prompts, task_heads
from rayfed.seeding import SERVER, torch_seed
from rayfed.tasks import Task

TensorDict = dict[str, torch.Tensor]

BACKBONES = (
    "tiny:vit", "tiny:clip-vision", "tiny-pretrained:vit", "tiny-pretrained:clip-vision",
    "tiny-pretrained:clip", "tiny-pretrained:open_clip", "tiny-pretrained:open_clip-deep",
    "tiny-pretrained:vit-ladder-t|s|b (the FedYolo scale ladder, 32 px)",
    "vit:T|S|B|L (randomly initialised ViT-Tiny/Small/Base/Large, patch 16, 224 px)",
    "hf:<name or local path> (ViT or CLIP vision tower)",
    "open_clip:<arch> (image tower; model.pretrained = tag or file)",
)

_TINY_SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

# The study's ViT sizes (spec fedyolo.md §1): hidden size, blocks, heads, MLP width.
VIT_SIZES = {
    "T": dict(hidden_size=192, num_hidden_layers=12, num_attention_heads=3, intermediate_size=768),
    "S": dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536),
    "B": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "L": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


@dataclass
class Backbone:
    """A frozen image encoder: ``encoder(pixel_values)`` -> features of size ``feature_dim``."""

    encoder: nn.Module
    feature_dim: int
    image_size: int
    num_channels: int
    pooling: str  # "cls": first token of last_hidden_state; "pooler": pooler_output; "output": the output tensor


def build_backbone(config: ModelConfig, seed: int) -> Backbone:
    """Build (or load) the backbone named by ``model.backbone``; random parts seeded by ``seed``."""
    name = config.backbone
    torch.manual_seed(seed)
    if name == "tiny:vit":
        vit_config = transformers.ViTConfig(
            **_TINY_SIZES, image_size=config.image_size or 16, patch_size=4, num_channels=3,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        encoder = transformers.ViTModel(vit_config, add_pooling_layer=False)
        return _frozen(Backbone(encoder, vit_config.hidden_size, vit_config.image_size, 3, "cls"))
    if name.startswith("vit:"):
        size = name.removeprefix("vit:")
        if size not in VIT_SIZES:
            raise choice_error("model.backbone", name, [f"vit:{s}" for s in VIT_SIZES])
        vit_config = transformers.ViTConfig(**VIT_SIZES[size], image_size=config.image_size or 224, patch_size=16)
        encoder = transformers.ViTModel(vit_config, add_pooling_layer=False)
        return _frozen(Backbone(encoder, vit_config.hidden_size, vit_config.image_size, 3, "cls"))
    if name == "tiny:clip-vision":
        clip_config = transformers.CLIPVisionConfig(
            **_TINY_SIZES, image_size=config.image_size or 16, patch_size=4, num_channels=3
        )
        encoder = transformers.CLIPVisionModel(clip_config)
        return _frozen(Backbone(encoder, clip_config.hidden_size, clip_config.image_size, 3, "pooler"))
    if name in ("tiny-pretrained:open_clip", "tiny-pretrained:open_clip-deep"):
        from rayfed.clip import load_clip  # the full CLIP, loaded once per process for text-classifying methods

        return _frozen(_open_clip_visual_backbone(load_clip(name, None).model.visual))
    if name.startswith("tiny-pretrained:"):
        from rayfed.zoo import FAMILIES, pretrained  # built once on first use, then read from the cache

        family = name.removeprefix("tiny-pretrained:")
        if family not in FAMILIES:
            raise choice_error("model.backbone", name, [f"tiny-pretrained:{f}" for f in FAMILIES])
        return _frozen(_load_hf_backbone(str(pretrained(family)), config, shown_as=name))
    if name.startswith("hf:"):
        return _frozen(_load_hf_backbone(name.removeprefix("hf:"), config))
    if name.startswith("open_clip:"):
        return _frozen(_load_open_clip_visual(name.removeprefix("open_clip:"), config))
    raise choice_error(
        "model.backbone", name,
        ["tiny:vit", "tiny:clip-vision", "tiny-pretrained:vit", "tiny-pretrained:clip-vision", "tiny-pretrained:clip",
         "tiny-pretrained:open_clip", "tiny-pretrained:open_clip-deep", "tiny-pretrained:vit-ladder-t|s|b",
         "hf:<name or path>", "open_clip:<arch>"],
    )  # fmt: skip


def _load_hf_backbone(name_or_path: str, config: ModelConfig, shown_as: str | None = None) -> Backbone:
    """A ViT or CLIP vision tower from a hub name or folder; errors name it as ``shown_as`` (default hf:<name>)."""
    shown_as = shown_as or f"hf:{name_or_path}"
    try:
        hf_config = transformers.AutoConfig.from_pretrained(name_or_path)
    except OSError as err:
        raise ConfigError(
            f"model.backbone = {shown_as!r} could not be loaded (not a local model folder, "
            f"and the hub is unreachable or has no such model): {str(err).splitlines()[0]}"
        ) from None
    if hf_config.model_type == "vit":
        encoder = transformers.ViTModel.from_pretrained(name_or_path, add_pooling_layer=False, dtype=torch.float32)
        vision = hf_config
        pooling = "cls"
    elif hf_config.model_type in ("clip", "clip_vision_model"):
        encoder = transformers.CLIPVisionModel.from_pretrained(name_or_path)
        vision = hf_config.vision_config if hf_config.model_type == "clip" else hf_config
        pooling = "pooler"
    else:
        raise ConfigError(
            f"model.backbone = {shown_as!r} is a {hf_config.model_type!r} model; "
            "allowed backbones of this kind are ViT and CLIP (vision tower) models."
        )
    if config.image_size and config.image_size != vision.image_size:
        raise ConfigError(
            f"model.image_size = {config.image_size} does not match the pretrained backbone's "
            f"{vision.image_size}; leave model.image_size unset for pretrained backbones."
        )
    return Backbone(encoder, vision.hidden_size, vision.image_size, vision.num_channels, pooling)


def _load_open_clip_visual(arch: str, config: ModelConfig) -> Backbone:
    """The image tower of an open_clip model; ``model.pretrained`` is a tag (e.g. openai) or a weights file."""
    import open_clip

    if arch not in open_clip.list_models():
        raise choice_error("model.backbone", f"open_clip:{arch}", [f"open_clip:{a}" for a in open_clip.list_models()])
    try:
        visual = open_clip.create_model(arch, pretrained=config.pretrained).visual
    except (RuntimeError, OSError) as err:
        raise ConfigError(
            f"model.pretrained = {config.pretrained!r} could not be loaded for open_clip:{arch} "
            f"({str(err).splitlines()[0]})."
        ) from None
    return _open_clip_visual_backbone(visual)


def _open_clip_visual_backbone(visual: nn.Module) -> Backbone:
    image_size = visual.image_size[0] if isinstance(visual.image_size, tuple) else visual.image_size
    return Backbone(visual, visual.output_dim, image_size, 3, "output")


def _frozen(backbone: Backbone) -> Backbone:
    backbone.encoder.requires_grad_(False)
    backbone.encoder.eval()
    return backbone


class TrainableModule(nn.Module):
    """A model whose trainable parameters (``requires_grad``) are what a method's client state holds."""

    def trainable_names(self) -> list[str]:
        return [name for name, param in self.named_parameters() if param.requires_grad]

    def trainable_params(self) -> TensorDict:
        return {name: param.detach().clone() for name, param in self.named_parameters() if param.requires_grad}

    @torch.no_grad()
    def load_trainable(self, values: TensorDict) -> None:
        params = dict(self.named_parameters())
        for name, value in values.items():
            params[name].copy_(value)


class ClientModel(TrainableModule):
    """Backbone (+ adapters) -> features -> linear head. ``trainable`` lists what methods train.

    Inputs are raw images, (N, C, H, W) floats in [0, 1] at any size: the model resizes and
    normalizes them on its own device, so clients keep only their small raw images in memory.
    """

    def __init__(self, backbone: Backbone, num_classes: int):
        super().__init__()
        self.encoder = backbone.encoder
        self.pooling = backbone.pooling
        self.image_size = backbone.image_size
        self.num_channels = backbone.num_channels
        self.head = nn.Linear(backbone.feature_dim, num_classes)

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """Raw [0, 1] images -> the backbone's size and channels, normalized to [-1, 1]."""
        if images.shape[1] != self.num_channels:
            images = images.expand(-1, self.num_channels, -1, -1)
        if images.shape[-2:] != (self.image_size, self.image_size):
            images = nn.functional.interpolate(
                images, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False
            )
        return (images - 0.5) / 0.5

    def features(self, images: torch.Tensor) -> torch.Tensor:
        if self.pooling == "output":
            return self.encoder(self.pixels(images))
        out = self.encoder(pixel_values=self.pixels(images))
        if self.pooling == "pooler":
            return out.pooler_output
        return out.last_hidden_state[:, 0]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def build_client_model(backbone: Backbone, config: ModelConfig, num_classes: int, seed: int) -> ClientModel:
    """A fresh client model over a private copy of ``backbone``; initial values depend on ``seed`` only."""
    torch.manual_seed(seed)
    model = ClientModel(copy.deepcopy(backbone), num_classes)
    _attach_module(model, config, [Task(0, "task", ("",) * num_classes)], lambda block: False, seed)
    model.head.requires_grad_(True)
    return model


def build_task_model(
    backbone: Backbone, config: ModelConfig, tasks: Sequence[Task], seed: int,
    dedicated: Callable[[int], bool] | None = None,
) -> ClientModel:
    """A client model over every task: one head per task (``head.task_<i>``) and ``config.module``, on
    each block shared by all tasks or, where ``dedicated(block)``, one copy per task. With one task and
    no dedicated blocks: :func:`build_client_model` (one ``head``)."""
    if len(tasks) == 1 and dedicated is None:
        return build_client_model(backbone, config, tasks[0].num_classes, seed)
    dedicated = dedicated or (lambda block: False)
    if config.module in ("lora", "full") and any(dedicated(block) for block in range(num_blocks(backbone))):
        raise ConfigError(
            f"model.module = {config.module!r} cannot have a copy per task; per-task modules are adapter, vpt or head."
        )
    torch.manual_seed(seed)
    model = ClientModel(copy.deepcopy(backbone), 1)
    model.head = task_heads(backbone.feature_dim, tasks, _seeds(seed))
    _attach_module(model, config, tasks, dedicated, seed)
    model.head.requires_grad_(True)
    return model


def _seeds(seed: int) -> Callable[[str], int]:
    return lambda purpose: torch_seed(seed, 0, SERVER, purpose)


def num_blocks(backbone: Backbone) -> int:
    """The number of transformer blocks of an HF backbone (0 if it has no HF config)."""
    return getattr(getattr(backbone.encoder, "config", None), "num_hidden_layers", 0)


def _attach_module(
    model: ClientModel, config: ModelConfig, tasks: Sequence[Task], dedicated: Callable[[int], bool], seed: int
) -> None:
    """Add ``config.module`` to the model's encoder and mark what it trains (the head is trained always)."""
    encoder_config = getattr(model.encoder, "config", None)
    if config.module in ("adapter", "vpt") and encoder_config is None:
        raise ConfigError(
            f"model.module = {config.module!r} needs an HF ViT or CLIP vision backbone; "
            f"model.backbone = {config.backbone!r} is not one (use lora, head or full)."
        )
    if config.module == "lora":
        _inject_lora(model, config.lora)
    elif config.module == "full":
        model.encoder.requires_grad_(True)
    elif config.module == "adapter":
        add_adapters(model.encoder, encoder_config.hidden_size, config.adapter.dim, tasks, dedicated, _seeds(seed))
    elif config.module == "vpt":
        add_prompts(
            model.encoder, encoder_config.hidden_size, config.vpt.prompts, encoder_config.patch_size,
            encoder_config.num_channels, tasks, dedicated, _seeds(seed),
        )


def _inject_lora(model: ClientModel, lora: LoraConfig) -> None:
    module_names = {name.rsplit(".", 1)[-1] for name, _ in model.encoder.named_modules()}
    missing = [t for t in lora.targets if t not in module_names]
    if missing:
        linear_names = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.encoder.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ConfigError(
            f"model.lora.targets = {list(lora.targets)!r} names modules the backbone lacks ({', '.join(missing)}); "
            f"its linear layers are: {', '.join(linear_names)}."
        )
    peft_config = peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.targets)
    )
    model.encoder = peft.inject_adapter_in_model(peft_config, model.encoder)
    for name, param in model.encoder.named_parameters():
        param.requires_grad_("lora_" in name)
    for module in model.encoder.modules():
        # peft casts bf16 activations to the fp32 LoRA weights' dtype, and autocast casts them straight back:
        # the same numbers for two copies of every activation (10% of a ViT-B/16 step on an H200).
        if hasattr(module, "cast_input_dtype_enabled"):
            module.cast_input_dtype_enabled = False


def check_image_channels(num_channels: int, backbone: Backbone) -> None:
    if num_channels not in (1, backbone.num_channels):
        raise ConfigError(
            f"data has {num_channels}-channel images but model.backbone expects {backbone.num_channels}; "
            "only 1-channel images are converted automatically."
        )


def to_tensor_images(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, C) numpy floats in [0, 1] -> (N, C, H, W) float32 tensor."""
    return torch.as_tensor(images, dtype=torch.float32).permute(0, 3, 1, 2).contiguous()
