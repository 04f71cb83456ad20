"""The decoders of TAP's modular model: a classifier per classification task, one image head for every
image-generation task and one parallel text decoder for every text-generation task (docs/tap.md#the-model)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rayfed.tasks.kinds import end_of_text_id
from rayfed.lazy import DeferredModule

transformers = DeferredModule("transformers")


class ClassificationHead(nn.Sequential):
    """FLAVA: ``Linear(D, D/2) -> ReLU -> Dropout(0.3) -> Linear``; ViLT: ``Linear(D, 4D) -> LN -> GELU ->
    Dropout(0.1) -> Linear(4D, D) -> GELU -> Linear`` (App. D.1); the last layer Xavier-uniform, zero bias."""

    def __init__(self, family: str, width: int, classes: int):
        if family == "flava":
            layers = [nn.Linear(width, width // 2), nn.ReLU(), nn.Dropout(0.3), nn.Linear(width // 2, classes)]
        else:
            layers = [nn.Linear(width, 4 * width), nn.LayerNorm(4 * width), nn.GELU(), nn.Dropout(0.1),
                      nn.Linear(4 * width, width), nn.GELU(), nn.Linear(width, classes)]
        super().__init__(*layers)
        nn.init.xavier_uniform_(self[-1].weight)
        nn.init.zeros_(self[-1].bias)


class ImageGenerationHead(nn.Module):
    """Features -> an image: ``Linear(D, 64 s s)``, three ``ConvTranspose(k4, s2, p1)`` with ReLU between (no
    output activation) -> (3, 8s, 8s); one head for every image-generation task, its output resized to each
    task's image shape (and averaged over colours for a one-channel task)."""

    def __init__(self, width: int, size: int):
        super().__init__()
        self.start = max(math.ceil(size / 8), 1)
        self.proj = nn.Linear(width, 64 * self.start * self.start)
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, 3, 4, stride=2, padding=1),
        )  # fmt: skip

    def forward(self, features: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        images = self.decoder(self.proj(features).view(len(features), 64, self.start, self.start))
        channels, height, width = shape
        if images.shape[-2:] != (height, width):
            images = nn.functional.interpolate(images, size=(height, width), mode="bilinear", align_corners=False)
        return images.mean(dim=1, keepdim=True) if channels == 1 else images


class TextGenerationHead(nn.Module):
    """The code's "conditional GPT-2" text decoder, parallel: ``positions`` learned position queries attend
    (8 heads) to the pooled features, pass through a 1-layer GPT-2 (4 heads, inner 2D) as input embeddings, and
    a bias-free linear layer maps them to the vocabulary: logits (B, positions, V) in one pass."""

    def __init__(self, width: int, vocabulary: int, positions: int, conditioned: bool):
        super().__init__()
        self.positions, self.conditioned = positions, conditioned
        config = transformers.GPT2Config(vocab_size=vocabulary, n_embd=width, n_layer=1, n_head=4,
                                         n_positions=positions, n_inner=2 * width)
        self.gpt2 = transformers.GPT2Model(config)
        self.gpt2.wte.requires_grad_(False)  # token embeddings: unused (the decoder reads input embeddings)
        self.lm_head = nn.Linear(width, vocabulary, bias=False)
        self.position_embeddings = nn.Embedding(positions, width)
        self.cond_attention = nn.MultiheadAttention(width, num_heads=8, batch_first=True)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        queries = self.position_embeddings.weight.unsqueeze(0).expand(len(features), -1, -1)
        if self.conditioned:
            context = features.unsqueeze(1)
            queries = queries + self.cond_attention(queries, context, context, need_weights=False)[0]
        hidden = self.gpt2(inputs_embeds=queries, use_cache=False).last_hidden_state  # one pass: no cache to fill
        return self.lm_head(hidden)


def decoded_tokens(raw: torch.Tensor, tokenizer: Any, max_new_tokens: int) -> torch.Tensor:
    """The text decoder's argmax token at every position, cut after the first end-of-text (pad after it)."""
    tokens = raw.argmax(dim=-1)
    pad, eos = tokenizer.pad_token_id, end_of_text_id(tokenizer)
    ended = (tokens == eos).long().cumsum(dim=1) - (tokens == eos).long() > 0
    tokens = tokens.masked_fill(ended, pad)
    if tokens.shape[1] < max_new_tokens:
        tokens = nn.functional.pad(tokens, (0, max_new_tokens - tokens.shape[1]), value=pad)
    return tokens[:, :max_new_tokens]
