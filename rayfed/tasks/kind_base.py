"""What every task kind shares: the :class:`TaskKind` base class (a plug-in kind derives from it), the label of
positions no loss is taken on (:data:`IGNORE`), and the built-in kinds' inputs (images, input text) with the checks
that a dataset and a backbone can provide them. The built-in kinds are in :mod:`rayfed.tasks.kinds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from torch import nn

from rayfed.tasks.texts import prompts, tokenize
from rayfed.data.batches import Columns
from rayfed.errors import ConfigError
from rayfed.types import Batch

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset
    from rayfed.tasks.kind_protocols import HeadTask, TaskModel
    from rayfed.models.backbone import Backbone

IGNORE = -100  # label of positions no loss is taken on


class TaskKind:
    """Base class of task kinds; subclasses set the class variables and override the methods."""

    name: ClassVar[str] = ""
    metrics: ClassVar[tuple[str, ...]] = ()  # reported as local_<metric>, in this order
    primary: ClassVar[str] = ""  # the metric streams average over tasks (self_<primary>, others_<primary>)
    shared_metrics: ClassVar[tuple[str, ...]] = ()  # reported on shared evaluation sets as <set>_<metric>
    lower_is_better: ClassVar[frozenset[str]] = frozenset({"loss"})
    forward_inputs: ClassVar[tuple[str, ...] | None] = None  # the columns forward reads (None: it may read any)

    def check_data(self, dataset: ArrayDataset, where: str) -> None:
        """Raise one sentence if ``dataset`` lacks the columns this kind needs (``where``: its config section)."""

    def check(self, dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
        """Raise one sentence if ``backbone`` cannot run this kind on ``dataset``."""

    def check_model(self, model: TaskModel, backbone: Backbone, where: str) -> None:
        """Raise one sentence if a method's ``model`` cannot produce this kind's outputs."""

    def task_fields(self, dataset: ArrayDataset) -> dict[str, Any]:
        """What a :class:`~rayfed.tasks.Task` of this kind records of its dataset (class names, shapes)."""
        return {"class_names": dataset.class_names}

    def encode(self, dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
        """The samples ``indices`` of ``dataset`` as named tensors for ``backbone``."""
        raise NotImplementedError

    def build_head(self, backbone: Backbone, task: HeadTask) -> nn.Module | None:
        """What the default client model adds for this task over the backbone's features (None: nothing)."""
        return None

    def forward(self, model: TaskModel, batch: Batch) -> torch.Tensor:
        """The model's outputs on ``batch``, which :meth:`loss` scores."""
        return model.head(model.features(batch))

    def loss(self, outputs: torch.Tensor, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def score(self, model: TaskModel, batch: Batch) -> dict[str, float]:
        """Sums over the test ``batch`` (under ``torch.no_grad``) that :meth:`summarize` turns into metrics."""
        raise NotImplementedError

    def score_rows(self, model: TaskModel, batch: Batch) -> dict[str, torch.Tensor]:
        """:meth:`score`'s values row by row (each a float64 tensor over the batch's rows), for a kind that scores
        several tasks' test sets in one pass (:meth:`merge_columns`)."""
        raise NotImplementedError

    def merge_columns(self, columns: Sequence[Columns], pad_token_id: int | None) -> Columns | None:
        """Several tasks' test columns as one set whose rows :meth:`score_rows` scores each as its own task would,
        for a model that runs these tasks through the same forward; None (the default): score each on its own."""
        return None

    def summarize(self, sums: dict[str, float], count: int) -> dict[str, float]:
        """The metrics from the sums of every test batch over ``count`` samples."""
        raise NotImplementedError


# Inputs ----------------------------------------------------------------------------------------------
def image_tensor(images: np.ndarray) -> torch.Tensor:
    """(N, H, W, C) numpy images, uint8 pixels 0..255 or floats in [0, 1], -> (N, C, H, W) float32 tensor in [0, 1];
    (N, K, H, W, C) -> (N, K, C, H, W).

    uint8 pixels are divided by 255 in float32, which rounds each of the 256 values to the float32 nearest to
    its exact quotient, as dividing in float64 and rounding to float32 does (a test checks every value)."""
    if images.dtype == np.uint8:
        images = np.divide(images, np.float32(255), dtype=np.float32)
    channels_first = (0, 3, 1, 2) if images.ndim == 4 else (0, 1, 4, 2, 3)
    return torch.as_tensor(images, dtype=torch.float32).permute(*channels_first).contiguous()


def image_columns(dataset: ArrayDataset, indices: np.ndarray) -> Columns:
    """``pixel_values`` (B, C, H, W); for samples of several images (B, K, C, H, W) and ``image_counts`` (B,)."""
    if dataset.images is None:
        return {}
    columns = {"pixel_values": image_tensor(dataset.images[indices])}
    if dataset.image_counts is not None:
        columns["image_counts"] = torch.as_tensor(dataset.image_counts[indices], dtype=torch.int64)
    return columns


def valid_images(pixels: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The (B, K, C, H, W) images of samples with ``counts`` (B,) images each -> (sum of counts, C, H, W), sample by
    sample, without the zero images that pad a sample to K."""
    return pixels[torch.arange(pixels.shape[1], device=pixels.device) < counts.to(pixels.device)[:, None]]


def input_columns(dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> Columns:
    """The images (``pixel_values``) and input text (``input_ids``, ``attention_mask``) a backbone reads."""
    columns = image_columns(dataset, indices)
    if dataset.text is not None and "text" in backbone.modalities:
        columns["input_ids"], columns["attention_mask"] = tokenize(prompts(dataset, indices, backbone), backbone)
    return columns


def check_inputs(dataset: ArrayDataset, backbone: Backbone, kind: str, where: str) -> None:
    """The backbone must read the dataset's inputs: images, text or both."""
    needs = {name for name, column in (("image", dataset.images), ("text", dataset.text)) if column is not None}
    if not needs:
        raise ConfigError(f"{where}.kind = {kind!r} needs inputs, but {where}.source has no images and no input text.")
    check_images_per_sample(dataset, backbone, where)
    missing = needs - backbone.modalities
    if missing:
        words = {"image": "images", "text": "text"}
        reads, lacks = (" and ".join(words[m] for m in sorted(ms)) for ms in (backbone.modalities, missing))
        raise ConfigError(
            f"{backbone.config_field} = {backbone.name!r} reads {reads} only and cannot run {where}.kind = {kind!r} "
            f"on the {lacks} of {where}.source; use a backbone that reads "
            f"{' and '.join(words[m] for m in sorted(needs))} (e.g. tiny-pretrained:vilt, tiny-pretrained:flava"
            f"{', tiny-pretrained:llama-small' if needs == {'text'} else ', tiny-pretrained:llava'})."
        )


def check_images_per_sample(dataset: ArrayDataset, backbone: Backbone, where: str) -> None:
    """Samples of several images need a backbone that reads them as image tokens in its prompt (LLaVA)."""
    if dataset.image_counts is not None and not backbone.image_prompt:
        raise ConfigError(
            f"{backbone.config_field} = {backbone.name!r} reads one image a sample, but {where}.image_column holds "
            f"up to {dataset.images.shape[1]} images a sample; use a backbone that reads several (LLaVA: "
            "tiny-pretrained:llava or an hf: LLaVA checkpoint) or an image column of one image a sample."
        )


def require_column(dataset: ArrayDataset, column: str, kind: str, where: str, what: str) -> None:
    if getattr(dataset, column) is None:
        raise ConfigError(f"{where}.kind = {kind!r} needs {what}, which {where}.source does not have.")
