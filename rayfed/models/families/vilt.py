"""ViLT: its paper-size configuration, its pretrained loader and its backbone."""

from __future__ import annotations

import functools
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rayfed.lazy import DeferredModule
from rayfed.models.backbone import IMAGE, TEXT, Backbone
from rayfed.models.families.common import PaperModel, _image_normalization, _paper_size, _text_limit, _with_layers
from rayfed.models.features import vilt_features
from rayfed.models.fused_attention import fuse_self_attention

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


def _hf_vilt(name_or_path: str, dtype: torch.dtype | str) -> Backbone:
    from rayfed.zoo.tokenizers import load_tokenizer

    encoder = transformers.ViltModel.from_pretrained(name_or_path, dtype=dtype)
    return _vilt(encoder, load_tokenizer(name_or_path), _image_normalization(name_or_path))


def _vilt(encoder: nn.Module, tokenizer: Any, normalization: Mapping[str, Any]) -> Backbone:
    config = encoder.config
    _embed_unpadded_images_without_host_syncs(encoder)
    fuse_self_attention(encoder)
    return Backbone(
        encoder, config.hidden_size, config.image_size, config.num_channels, vilt_features,
        frozenset({IMAGE, TEXT}), tokenizer=tokenizer,
        text_limit=_text_limit(tokenizer, config.max_position_embeddings), lora_targets=("query", "value"),
        **normalization,
    )  # fmt: skip


def _embed_unpadded_images_without_host_syncs(encoder: nn.Module) -> None:
    """ViLT's patch embedding handles images padded to different sizes: it reads each image's size and valid patches
    back to the host (about 6 syncs an image on a GPU: 200 a batch of 32). A call without ``pixel_mask`` (rayfed's
    batches: every image has the processor's size) has no padding, so each image keeps all its patches and only the
    order of its tokens is drawn; this embeds such a batch with the same draws of the host's generator and the same
    products, hence bitwise the same tokens, without reading anything back; on a GPU the order is drawn on the
    device (:func:`device_patch_order`). A call with a mask runs transformers'."""
    # One note the encoder's hook writes and its embeddings read: a method may wrap the embeddings (prompt tuning's
    # PromptedViltEmbeddings), which then hold ViLT's as a submodule.
    padding = _Padding()
    encoder.register_forward_pre_hook(functools.partial(_note_padding, padding), with_kwargs=True)
    encoder.embeddings.padding = padding
    encoder.embeddings.visual_embed = types.MethodType(_visual_embed, encoder.embeddings)


class _Padding:
    """Whether the images of the encoder's current call are unpadded (no ``pixel_mask``)."""

    unpadded = False


def _note_padding(padding: _Padding, encoder: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    padding.unpadded = (args[4] if len(args) > 4 else kwargs.get("pixel_mask")) is None


def device_patch_order(batch_size: int, count: int, chosen: int, device: torch.device) -> torch.Tensor:
    """Which ``chosen`` of an image's ``count`` patches it keeps, in a random order, for each of ``batch_size``
    images (batch_size, chosen): drawn on ``device``, a GPU's generator, where a CUDA graph captures the draw with
    the step and replays a fresh one each time. transformers draws the order on the host and copies it to the
    device, which a capture cannot hold; the tokens' order changes only the order of the attention's sums, and the
    patches kept are as uniformly drawn."""
    return torch.rand(batch_size, count, device=device).argsort(dim=1)[:, :chosen]


def _visual_embed(
    self: nn.Module, pixel_values: torch.Tensor, pixel_mask: torch.Tensor, max_image_length: int = 200
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, tuple[int, int]]]:
    patches = self.patch_embeddings(pixel_values)
    batch_size, channels, height, width = patches.shape
    count = height * width
    chosen = count if max_image_length is None or max_image_length < 0 else max_image_length
    if not self.padding.unpadded or chosen > count:
        return type(self).visual_embed(self, pixel_values, pixel_mask, max_image_length)
    grid = self.config.image_size // self.config.patch_size
    spatial = self.position_embeddings[:, 1:, :].transpose(1, 2).view(1, channels, grid, grid)
    positions = nn.functional.interpolate(spatial, size=(height, width), mode="bilinear", align_corners=True)
    positions = positions.flatten(2).transpose(1, 2).expand(batch_size, -1, -1)
    if patches.is_cuda:
        columns = device_patch_order(batch_size, count, chosen, patches.device).flatten()
    else:  # transformers' draw: one multinomial a row, in row order, on the host's generator
        rows_order = [torch.multinomial(torch.ones(count).float(), chosen) for _ in range(batch_size)]
        columns = torch.stack(rows_order).flatten()
    rows = torch.arange(batch_size, device=patches.device).repeat_interleave(chosen)
    tokens = patches.flatten(2).transpose(1, 2)[rows, columns].view(batch_size, -1, channels)
    positions = positions[rows, columns].view(batch_size, -1, channels)
    grid_rows, grid_columns = (torch.arange(size, device=patches.device) for size in (height, width))
    cells = torch.stack(torch.meshgrid(grid_rows, grid_columns, indexing="ij"), dim=-1)
    patch_index = cells.flatten(0, 1)[columns].view(batch_size, -1, 2)
    first = self.position_embeddings[:, 0, :][:, None, :].expand(batch_size, -1, -1)
    tokens = (torch.cat((self.cls_token.expand(batch_size, -1, -1), tokens), dim=1)
              + torch.cat((first, positions), dim=1))
    mask = torch.ones(batch_size, chosen + 1, dtype=torch.long, device=patches.device)
    return self.dropout(tokens), mask, (patch_index, (height, width))
