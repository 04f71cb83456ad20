"""The encoders of TAP's modular model, one per input modality: the pretrained FLAVA or ViLT encoder (frozen, with
LoRA) between a trainable input adaptor (images) and a trainable projection to the model's width
(docs/tap.md#the-model)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from rayfed.methods.tap.layers import frozen_copy, with_lora
from rayfed.models import Backbone
from rayfed.models.client import channel_values


class InputAdaptor(nn.Sequential):
    """The code's trainable image adaptor: Upsample x2 -> Conv3x3 (no bias) -> GELU -> Upsample to the
    encoder's size -> Conv1x1. ``init = default``: PyTorch's (the code's); ``identity``: both convolutions start
    as the identity (Dirac kernels, zero bias), so the pretrained encoder first sees GELU(image)."""

    def __init__(self, size: int, init: str = "default"):
        super().__init__(
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True), nn.Conv2d(3, 3, 3, padding=1, bias=False),
            nn.GELU(), nn.Upsample(size=(size, size), mode="bilinear", align_corners=True), nn.Conv2d(3, 3, 1),
        )  # fmt: skip
        if init == "identity":
            nn.init.dirac_(self[1].weight)
            nn.init.dirac_(self[4].weight)
            nn.init.zeros_(self[4].bias)


class ImageEncoder(nn.Module):
    """Raw [0, 1] images -> tokens (B, 1 + patches, D): normalize, adapt, the frozen pretrained encoder with LoRA
    (FLAVA's image transformer; ViLT's patch projection, [CLS] and position embeddings), Linear + LayerNorm."""

    def __init__(self, backbone: Backbone, family: str, width: int, rank: int, dropout: float, adaptor: str):
        super().__init__()
        encoder, self.family = backbone.encoder, family
        self.size = backbone.image_size
        self.mean, self.std = backbone.image_mean, backbone.image_std
        self.input_adaptor = None if adaptor == "none" else InputAdaptor(self.size, adaptor)
        if family == "flava":
            self.backbone = with_lora(frozen_copy(encoder.image_model), ["query", "value"], rank, dropout)
            hidden = encoder.config.image_config.hidden_size
        else:
            embeddings = encoder.embeddings
            self.backbone = with_lora(frozen_copy(embeddings.patch_embeddings), ["projection"], rank, dropout)
            self.cls_token = nn.Parameter(embeddings.cls_token.detach().clone(), requires_grad=False)
            positions = embeddings.position_embeddings.detach().clone()
            self.position_embeddings = nn.Parameter(positions, requires_grad=False)
            hidden = encoder.config.hidden_size
        self.proj = nn.Linear(hidden, width)
        self.layer_norm = nn.LayerNorm(width)

    def _normalized(self, images: torch.Tensor) -> torch.Tensor:
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        mean = channel_values(self.mean, images.device, images.dtype)
        std = channel_values(self.std, images.device, images.dtype)
        return (images - mean) / std

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._normalized(images)
        if self.input_adaptor is not None:
            x = self.input_adaptor(x)
        elif x.shape[-2:] != (self.size, self.size):
            x = nn.functional.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        if self.family == "flava":
            tokens = self.backbone(pixel_values=x).last_hidden_state
        else:
            patches = self.backbone(x).flatten(2).transpose(1, 2)
            tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), patches], dim=1)
            tokens = tokens + self.position_embeddings[:, : tokens.shape[1]]
        tokens = self.layer_norm(self.proj(tokens))
        return tokens, torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)


def _packed(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The real tokens of each row moved to its start (a left-padded prompt becomes right-padded)."""
    order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)
    return ids.gather(1, order), mask.gather(1, order)


def attention_bias(mask: torch.Tensor) -> torch.Tensor:
    """transformers' 4D attention bias of a padding mask for FLAVA's eager attention (0 where a token is seen, float32's
    lowest where it is padding; float32, the dtype of the text embeddings' LayerNorm under autocast too), made on the
    device. transformers' own reads the mask back to the host to skip an all-ones mask (a host sync per forward) and
    otherwise copies a host scalar, which a captured step (``train.cuda_graphs``) cannot hold. Adding the zeros of an
    all-ones mask leaves the attention scores as they are, bitwise."""
    padding = (mask == 0)[:, None, None, :]
    bias = torch.zeros(padding.shape, device=mask.device).masked_fill(padding, torch.finfo(torch.float32).min)
    return bias.expand(-1, -1, mask.shape[1], -1)


class TextEncoder(nn.Module):
    """Token ids -> tokens (B, S, D): FLAVA's frozen text transformer with LoRA on query/value, or ViLT's frozen
    word + position + type embeddings; then Linear + LayerNorm. A text longer than the encoder's position table
    is cut into windows of that length, each encoded on its own."""

    def __init__(self, backbone: Backbone, family: str, width: int, rank: int, dropout: float):
        super().__init__()
        encoder, self.family = backbone.encoder, family
        if family == "flava":
            self.backbone = with_lora(frozen_copy(encoder.text_model), ["query", "value"], rank, dropout)
            config = encoder.config.text_config
        else:
            self.backbone = frozen_copy(encoder.embeddings.text_embeddings)
            config = encoder.config
        self.window = config.max_position_embeddings
        self.proj = nn.Linear(config.hidden_size, width)
        self.layer_norm = nn.LayerNorm(width)
        self.fixed_windows: int | None = None  # while a CUDA graph is captured (taking_windows)

    def windows(self, mask: torch.Tensor) -> int:
        """How many windows encode the longest text of ``mask``: read back to the host when texts may be longer
        than one window."""
        if mask.shape[1] <= self.window:  # one window whatever the lengths: no need to read them
            return 1
        return math.ceil(max(int(mask.sum(dim=1).max()), 1) / self.window)

    @contextlib.contextmanager
    def taking_windows(self, windows: int) -> Iterator[None]:
        """Encode ``windows`` windows in the forwards within, whatever the lengths (nothing read back)."""
        self.fixed_windows = windows
        try:
            yield
        finally:
            self.fixed_windows = None

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.fixed_windows or self.windows(mask)
        ids, mask = _packed(ids, mask)
        length = windows * self.window
        if ids.shape[1] < length:
            pad = length - ids.shape[1]
            ids, mask = nn.functional.pad(ids, (0, pad)), nn.functional.pad(mask, (0, pad))
        ids, mask = ids[:, :length], mask[:, :length]
        size = len(ids)
        flat_ids, flat_mask = ids.reshape(size * windows, self.window), mask.reshape(size * windows, self.window)
        if self.family == "flava":
            tokens = self.backbone(input_ids=flat_ids, attention_mask=attention_bias(flat_mask)).last_hidden_state
        else:
            tokens = self.backbone(input_ids=flat_ids, token_type_ids=torch.zeros_like(flat_ids))
        tokens = tokens.reshape(size, length, -1)
        return self.layer_norm(self.proj(tokens)), mask
