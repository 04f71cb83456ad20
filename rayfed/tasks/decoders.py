"""Decoders that turn a backbone's features back into an input modality (the reconstruction kind's head)."""

from __future__ import annotations

import torch
from torch import nn


class ImageDecoder(nn.Module):
    """Features -> an image: a linear layer to a 64-channel map at 1/8 of the size, three transposed
    convolutions doubling it (ReLU between, none after)."""

    def __init__(self, feature_dim: int, shape: tuple[int, int, int]):
        super().__init__()
        channels, height, width = shape
        self.shape = shape
        self.start = (max(height // 8, 1), max(width // 8, 1))
        self.project = nn.Linear(feature_dim, 64 * self.start[0] * self.start[1])
        self.upsample = nn.Sequential(
            nn.ConvTranspose2d(64, 32, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), nn.ReLU(),
            nn.ConvTranspose2d(16, channels, 4, stride=2, padding=1),
        )

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        images = self.upsample(self.project(features).view(len(features), 64, *self.start))
        if images.shape[-2:] != self.shape[1:]:
            images = nn.functional.interpolate(images, size=self.shape[1:], mode="bilinear", align_corners=False)
        return images
