"""Part-texture images: the synthetic upstream and downstream tasks of our offline version of the scale study of
*Augmenting Federated Learning with Pretrained Transformers* (arXiv 2307.04905)
(docs/fedyolo.md#offline-results-on-the-scale-ladder), in which pretraining transfers.

A fixed *world* (seeded by ``world``, not by the run's seed) holds a bank of small textured parts and
the classes built from them. A class is a spatial layout, ``PARTS_PER_CLASS`` (cell, part) pairs on a
4 x 4 grid of 8-pixel cells, plus a background colour. A sample renders its class's layout with a
global shift, per-part jitter and colour change, one distractor part on a free cell, a brightness
factor and pixel noise.

Three label spaces share the bank:

- ``upstream``: ``UPSTREAM_CLASSES`` layouts for pretraining;
- ``fine`` ("C100-like"): ``FINE_CLASSES`` other layouts, each the two pairs of its super-class's core
  plus two pairs of its own;
- ``coarse`` ("C10-like", the related task): the ``COARSE_CLASSES`` super-classes, a fine class's label
  being ``fine // 10``.

No fine layout equals an upstream one, so downstream classes are new combinations of known parts. The data source
``parts`` serves them to a run (``data.options``: ``label_space``, ``world``, ``num_samples``, ``noise``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfed.data.sources import (
    ArrayDataset, DataError, SourceRequest, generator_options, non_negative, require_no_group_column, require_no_split,
)
from rayfed.registry import register_source

VERSION = 1  # bump when the same arguments generate different images (pretrained ladder models rebuild)

IMAGE_SIZE = 32
CELL = 8
GRID = IMAGE_SIZE // CELL
NUM_PARTS = 64
PARTS_PER_CLASS = 4
UPSTREAM_CLASSES = 256
FINE_CLASSES = 100
COARSE_CLASSES = 10
LABEL_SPACES = ("upstream", "fine", "coarse")

_PURPOSE_WORLD = 3001
_PURPOSE_SAMPLES = {"upstream": 3002, "fine": 3003, "coarse": 3004}


@dataclass(frozen=True, eq=False)
class World:
    textures: np.ndarray  # (NUM_PARTS, CELL, CELL, 3) in [0, 1]
    upstream: np.ndarray  # (UPSTREAM_CLASSES, PARTS_PER_CLASS, 2): (cell, part) pairs
    fine: np.ndarray  # (FINE_CLASSES, PARTS_PER_CLASS, 2)
    backgrounds: dict[str, np.ndarray]  # label space -> (classes, 3) background colour per layout


@functools.lru_cache(maxsize=4)
def world(seed: int = 0) -> World:
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_WORLD]))
    # A texture: two colours mixed by a thresholded sum of two random plane waves.
    ys, xs = np.mgrid[0:CELL, 0:CELL] / CELL
    textures = np.empty((NUM_PARTS, CELL, CELL, 3))
    for part in range(NUM_PARTS):
        freq = rng.uniform(1.0, 4.0, size=(2, 2)) * rng.choice([-1, 1], size=(2, 2))
        phase = rng.uniform(0, 2 * np.pi, size=2)
        wave = sum(np.sin(2 * np.pi * (f[0] * xs + f[1] * ys) + p) for f, p in zip(freq, phase))
        mask = (wave > rng.uniform(-0.5, 0.5))[..., None]
        colors = rng.uniform(0.0, 1.0, size=(2, 3))
        textures[part] = np.where(mask, colors[0], colors[1])

    def layouts(count: int, fixed: np.ndarray | None = None) -> np.ndarray:
        pairs = np.empty((count, PARTS_PER_CLASS, 2), dtype=np.int64)
        for k in range(count):
            start = 0 if fixed is None else len(fixed[k])
            taken = set() if fixed is None else {int(c) for c, _ in fixed[k]}
            free = [c for c in range(GRID * GRID) if c not in taken]
            cells = rng.choice(free, size=PARTS_PER_CLASS - start, replace=False)
            parts = rng.integers(0, NUM_PARTS, size=PARTS_PER_CLASS - start)
            if fixed is not None:
                pairs[k, :start] = fixed[k]
            pairs[k, start:] = np.stack([cells, parts], axis=1)
        return pairs

    upstream = layouts(UPSTREAM_CLASSES)
    cores = layouts(COARSE_CLASSES)[:, :2]  # each super-class: two (cell, part) pairs
    fine = layouts(FINE_CLASSES, fixed=np.repeat(cores, FINE_CLASSES // COARSE_CLASSES, axis=0))
    upstream_keys = {_key(layout) for layout in upstream}
    if len({_key(layout) for layout in fine} | upstream_keys) != UPSTREAM_CLASSES + FINE_CLASSES:
        raise RuntimeError(f"part world {seed} drew two identical layouts; use another data.synthetic.world")
    backgrounds = {
        "upstream": rng.uniform(0.0, 0.4, size=(UPSTREAM_CLASSES, 3)),
        "fine": rng.uniform(0.0, 0.4, size=(FINE_CLASSES, 3)),
    }
    return World(textures, upstream, fine, backgrounds)


def _key(layout: np.ndarray) -> frozenset[tuple[int, int]]:
    return frozenset((int(cell), int(part)) for cell, part in layout)


def class_names(label_space: str) -> tuple[str, ...]:
    count = {"upstream": UPSTREAM_CLASSES, "fine": FINE_CLASSES, "coarse": COARSE_CLASSES}[label_space]
    return tuple(f"{label_space}_{k}" for k in range(count))


def render(
    num_samples: int, *, label_space: str, seed: int, world_seed: int = 0, noise: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """``num_samples`` images (float32 (N, 32, 32, 3) in [0, 1]) and labels of ``label_space``, classes balanced."""
    space = world(world_seed)
    rng = np.random.default_rng(np.random.SeedSequence([seed, world_seed, _PURPOSE_SAMPLES[label_space]]))
    num_classes = len(class_names(label_space))
    labels = rng.permutation(np.arange(num_samples) % num_classes)
    if label_space == "coarse":  # a super-class sample is a sample of one of its fine classes
        per_group = FINE_CLASSES // COARSE_CLASSES
        layout_ids = labels * per_group + rng.integers(0, per_group, size=num_samples)
    else:
        layout_ids = labels
    layouts = space.upstream if label_space == "upstream" else space.fine
    backgrounds = space.backgrounds["upstream" if label_space == "upstream" else "fine"]

    margin = 2
    canvas = np.empty((num_samples, IMAGE_SIZE + 2 * margin, IMAGE_SIZE + 2 * margin, 3))
    canvas[:] = backgrounds[layout_ids][:, None, None, :]
    shifts = rng.integers(-margin, margin + 1, size=(num_samples, 2))
    jitter = rng.integers(-1, 2, size=(num_samples, PARTS_PER_CLASS + 1, 2))
    tint = 1.0 + rng.normal(0.0, 0.1, size=(num_samples, PARTS_PER_CLASS + 1, 3))
    distractor_parts = rng.integers(0, NUM_PARTS, size=num_samples)
    distractor_draws = rng.random((num_samples, GRID * GRID))
    layout = layouts[layout_ids]  # (N, PARTS_PER_CLASS, 2)
    np.put_along_axis(distractor_draws, layout[:, :, 0], np.inf, axis=1)  # the distractor takes a free cell
    distractor = np.stack([distractor_draws.argmin(axis=1), distractor_parts], axis=1)
    pairs = np.concatenate([layout, distractor[:, None]], axis=1)  # (N, PARTS_PER_CLASS + 1, 2)
    rows = margin + (pairs[..., 0] // GRID) * CELL + shifts[:, None, 0] + jitter[..., 0]
    cols = margin + (pairs[..., 0] % GRID) * CELL + shifts[:, None, 1] + jitter[..., 1]
    rows, cols = (np.clip(index, 0, IMAGE_SIZE + 2 * margin - CELL) for index in (rows, cols))
    offsets = np.arange(CELL)
    samples = np.arange(num_samples)[:, None, None]
    for slot in range(PARTS_PER_CLASS + 1):  # later parts are drawn over earlier ones
        row_index = (rows[:, slot, None] + offsets)[:, :, None]
        col_index = (cols[:, slot, None] + offsets)[:, None, :]
        canvas[samples, row_index, col_index] = space.textures[pairs[:, slot, 1]] * tint[:, slot, None, None, :]
    images = canvas[:, margin : margin + IMAGE_SIZE, margin : margin + IMAGE_SIZE]
    images = images * rng.uniform(0.7, 1.3, size=(num_samples, 1, 1, 1))
    images = images + rng.normal(0.0, noise, size=images.shape)
    return np.clip(images, 0.0, 1.0).astype(np.float32), labels.astype(np.int64)


_SOURCE_DEFAULTS: dict[str, Any] = {"num_samples": 6000, "label_space": "fine", "world": 0, "noise": 0.1}


@register_source("parts")
def parts_source(request: SourceRequest) -> ArrayDataset:
    """Part-texture layouts in one of their label spaces; the world is fixed by ``world``, the samples by the run's
    seed."""
    require_no_split(request.name, request.config.split)
    require_no_group_column(request.name, request.config.partition.column)
    params = generator_options(request.options, _SOURCE_DEFAULTS, " for 'parts'", ("num_samples",))
    if params["label_space"] not in LABEL_SPACES:
        raise DataError(
            f"data.options.label_space = {params['label_space']!r} is not known; allowed: {', '.join(LABEL_SPACES)}."
        )
    if isinstance(params["world"], bool) or not isinstance(params["world"], int) or params["world"] < 0:
        raise DataError(f"data.options.world = {params['world']!r} is invalid: it must be an integer >= 0.")
    noise = non_negative(params, "noise")
    images, labels = render(
        params["num_samples"], label_space=params["label_space"], seed=request.seed, world_seed=params["world"],
        noise=noise,
    )
    return ArrayDataset(images, labels, class_names(params["label_space"]))
