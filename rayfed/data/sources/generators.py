"""Generated image and text data: ``synthetic``, ``synthetic-text`` and ``shapes``."""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfed.data.sources.common import (
    _require_group_column, generator_options, non_negative, require_no_group_column, require_no_split,
)
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.registry import register_source

_SYNTHETIC_DEFAULTS: dict[str, float | int] = {
    "num_samples": 600,
    "num_classes": 10,
    "image_size": 8,
    "channels": 1,
    "noise": 0.3,
    "num_writers": 30,
}
SYNTHETIC_GROUP_COLUMN = "writer"  # the synthetic source's natural groups
_SYNTHETIC_TEXT_DEFAULTS: dict[str, int] = {"num_samples": 600, "prompt_words": 32, "target_words": 8}
_SHAPES_DEFAULTS: dict[str, Any] = {"num_samples": 4800, "styles": ["noisy"], "image_size": 32}
SHAPES_GROUP_COLUMN = "domain"  # the shapes source's natural groups: render styles
_WRITER_STYLE_SCALE = 0.15

_PURPOSE_SYNTHETIC = 1001
_PURPOSE_SYNTHETIC_TEXT = 1005


@register_source("synthetic")
def _make_synthetic(request: SourceRequest) -> ArrayDataset:
    """Class prototypes + per-writer style offset + Gaussian noise, clipped to [0, 1]; groups = writers."""
    require_no_split(request.name, request.config.split)
    _require_group_column(request.name, request.config.partition.column, SYNTHETIC_GROUP_COLUMN)
    params = generator_options(
        request.options, _SYNTHETIC_DEFAULTS, "",
        ("num_samples", "num_classes", "image_size", "channels", "num_writers"),
    )
    noise = non_negative(params, "noise")

    num_samples, num_classes, num_writers = params["num_samples"], params["num_classes"], params["num_writers"]
    image_shape = (params["image_size"], params["image_size"], params["channels"])
    rng = np.random.default_rng(np.random.SeedSequence([request.seed, _PURPOSE_SYNTHETIC]))
    prototypes = rng.uniform(0.0, 1.0, size=(num_classes, *image_shape))
    writer_styles = rng.normal(0.0, _WRITER_STYLE_SCALE, size=(num_writers, *image_shape))
    labels = rng.permutation(np.arange(num_samples) % num_classes)
    writers = rng.permutation(np.arange(num_samples) % num_writers)
    pixels = prototypes[labels] + writer_styles[writers] + rng.normal(0.0, noise, size=(num_samples, *image_shape))
    images = np.clip(pixels, 0.0, 1.0).astype(np.float32)
    class_names = tuple(f"class_{k}" for k in range(num_classes))
    return ArrayDataset(images, labels.astype(np.int64), class_names, writers.astype(np.int64))


@register_source("synthetic-text")
def _make_synthetic_text(request: SourceRequest) -> ArrayDataset:
    """Text generation of an exact length: a prompt of ``prompt_words`` random words of the offline vocabulary,
    its target the prompt's first ``target_words`` words (a copy task); one token per word for the word
    tokenizer of ``tiny-pretrained:`` and ``llama:`` backbones."""
    from rayfed.data.multimodal import vocabulary

    require_no_split(request.name, request.config.split)
    require_no_group_column(request.name, request.config.partition.column)
    params = generator_options(request.options, _SYNTHETIC_TEXT_DEFAULTS, " for 'synthetic-text'",
                               tuple(_SYNTHETIC_TEXT_DEFAULTS))
    if params["target_words"] > params["prompt_words"]:
        raise DataError(f"data.options.target_words = {params['target_words']} is more than prompt_words = "
                        f"{params['prompt_words']}; the target copies the prompt's first words.")
    words = np.asarray([word for word in vocabulary() if word.isalpha()], dtype=object)
    rng = np.random.default_rng(np.random.SeedSequence([request.seed, _PURPOSE_SYNTHETIC_TEXT]))
    prompts = words[rng.integers(0, len(words), size=(params["num_samples"], params["prompt_words"]))]
    return ArrayDataset(text=np.asarray([" ".join(row) for row in prompts], dtype=object),
                        target=np.asarray([" ".join(row[:params["target_words"]]) for row in prompts], dtype=object))


@register_source("shapes")
def _make_shapes(request: SourceRequest) -> ArrayDataset:
    """The 64 "{colour} {shape}" classes rendered in ``styles`` (:mod:`rayfed.data.multimodal`); groups = style.

    Class ids put the 32 classes with an even (shape + colour) index first, so that the first half (the
    base classes of a base-to-novel split) and the second half each hold every colour and every shape.
    """
    from rayfed.data import multimodal

    require_no_split(request.name, request.config.split)
    _require_group_column(request.name, request.config.partition.column, SHAPES_GROUP_COLUMN)
    params = generator_options(request.options, _SHAPES_DEFAULTS, " for 'shapes'", ("num_samples", "image_size"))
    distribution = multimodal.Distribution(multimodal.CLASSES, tuple(params["styles"]), ("shapes",))
    columns = multimodal.shape_columns(params["num_samples"], seed=request.seed, distribution=distribution,
                                       image_size=params["image_size"])  # fmt: skip
    order = sorted(range(len(multimodal.CLASSES)), key=lambda k: ((k // 8 + k % 8) % 2, k))
    class_names = tuple(multimodal.CLASSES[k] for k in order)
    labels = np.asarray([class_names.index(name) for name in columns["class_name"]], dtype=np.int64)
    styles = np.asarray([multimodal.STYLES.index(name) for name in columns["domain"]], dtype=np.int64)
    return ArrayDataset(columns["image"].astype(np.float32) / 255.0, labels, class_names, styles)
