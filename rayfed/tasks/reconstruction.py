"""The built-in ``reconstruction`` kind: an image -> the same image through a decoder head."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rayfed.tasks.decoders import ImageDecoder
from rayfed.tasks.kind_base import TaskKind, image_columns, require_column
from rayfed.data.batches import Columns
from rayfed.errors import ConfigError
from rayfed.registry import register_task_kind
from rayfed.types import Batch

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset
    from rayfed.tasks.kind_protocols import HeadTask, TaskModel
    from rayfed.models.backbone import Backbone


@register_task_kind("reconstruction")
class Reconstruction(TaskKind):
    """An image -> the same image (raw [0, 1] pixels), through a decoder head: mean squared error."""

    name = "reconstruction"
    metrics = ("mse",)
    primary = "mse"
    shared_metrics = ("mse",)
    lower_is_better = frozenset({"loss", "mse"})

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        require_column(dataset, "images", self.name, where, "images")
        if dataset.image_counts is not None:
            raise ConfigError(f"{where}.kind = {self.name!r} rebuilds one image a sample, but {where}.source has "
                              f"samples of up to {dataset.images.shape[1]} images; use a column of one image a sample.")

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        if "image" not in backbone.modalities:
            raise ConfigError(f"{backbone.config_field} = {backbone.name!r} reads no images and cannot run "
                              f"{where}.kind = {self.name!r}; use an image backbone.")

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        _, height, width, channels = dataset.images.shape
        return {"image_shape": (channels, height, width)}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        return image_columns(dataset, indices)

    def build_head(self, backbone: Backbone, task: HeadTask) -> nn.Module:
        return ImageDecoder(backbone.feature_dim, task.image_shape)

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        return nn.functional.mse_loss(outputs.float(), batch.get("target_pixels", batch["pixel_values"]))

    def score(self, model: TaskModel, batch: Batch) -> dict[str, float]:
        outputs = model(batch).float()
        target = batch.get("target_pixels", batch["pixel_values"])
        return {"mse": ((outputs - target) ** 2).flatten(1).mean(dim=1).sum().item()}

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        return {"mse": sums["mse"] / count}
