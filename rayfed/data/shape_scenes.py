"""The images of the synthetic multi-modal data (:mod:`rayfed.data.multimodal`): shapes, colours, textures and render
styles, the "{colour} {shape}" classes they make, the draws of objects from a :class:`Distribution`, and the renderer.

Same arguments and generator state give the same images, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rayfed.errors import ConfigError, choice_error

SHAPES = ("circle", "square", "triangle", "cross", "ring", "diamond", "star", "bar")
COLOR_RGB = {
    "red": (225, 35, 35),
    "green": (40, 170, 40),
    "blue": (40, 70, 230),
    "yellow": (240, 220, 30),
    "purple": (150, 40, 190),
    "cyan": (30, 210, 220),
    "orange": (250, 135, 0),
    "pink": (250, 130, 190),
}
COLORS = tuple(COLOR_RGB)
TEXTURES = ("solid", "striped", "checkered")
PRETRAIN_STYLES = ("plain", "gradient")
FINETUNE_STYLES = ("textured", "noisy", "sketch")
STYLES = PRETRAIN_STYLES + FINETUNE_STYLES
MAX_OBJECTS = 4  # VQA scenes hold 1..4 objects on a 2x2 grid

CLASSES = tuple(f"{color} {shape}" for shape in SHAPES for color in COLORS)  # id = shape * 8 + color
# Held out of every pretraining set: two colours per shape and two shapes per colour, so each word is
# still seen in pretraining and only the combination is new.
NOVEL_CLASSES = tuple(
    f"{color} {shape}" for s, shape in enumerate(SHAPES) for c, color in enumerate(COLORS) if (c - s) % 8 in (0, 3)
)
SEEN_CLASSES = tuple(name for name in CLASSES if name not in NOVEL_CLASSES)


@dataclass(frozen=True)
class Distribution:
    """Which classes and render styles images come from, and which tasks are drawn."""

    classes: tuple[str, ...]
    styles: tuple[str, ...]
    tasks: tuple[str, ...]


_SHAPE_MASKS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    # dx, dy: pixel offsets from the object's centre, in object radii (y grows downwards)
    "circle": lambda dx, dy: dx**2 + dy**2 <= 1.0,
    "square": lambda dx, dy: np.maximum(np.abs(dx), np.abs(dy)) <= 0.8,
    "triangle": lambda dx, dy: (dy >= -0.85) & (dy <= 0.75) & (np.abs(dx) <= (dy + 0.85) * 0.6),
    "cross": lambda dx, dy: (np.minimum(np.abs(dx), np.abs(dy)) <= 0.3) & (np.maximum(np.abs(dx), np.abs(dy)) <= 1.0),
    "ring": lambda dx, dy: (dx**2 + dy**2 <= 1.0) & (dx**2 + dy**2 >= 0.3),
    "diamond": lambda dx, dy: np.abs(dx) + np.abs(dy) <= 1.0,
    "star": lambda dx, dy: np.hypot(dx, dy) <= 0.4 + 0.6 * ((1 + np.sin(5 * np.arctan2(dy, dx))) / 2) ** 2,
    "bar": lambda dx, dy: (np.abs(dy) <= 0.35) & (np.abs(dx) <= 1.0),
}


def render(
    shape_ids: np.ndarray,
    color_ids: np.ndarray,
    texture_ids: np.ndarray,
    style_ids: np.ndarray,
    counts: np.ndarray,
    rng: np.random.Generator,
    image_size: int = 32,
) -> np.ndarray:
    """uint8 images (N, S, S, 3): ``counts[i]`` identical objects on a background of style ``style_ids[i]``.

    A single object is placed anywhere; several objects take distinct cells of a 2x2 grid.
    """
    n, size = len(shape_ids), image_size
    # Every random draw happens here, in a fixed order, so images depend on the seed only.
    gray = rng.uniform(0.7, 0.95, n).astype(np.float32)
    direction = rng.uniform(0, 2 * np.pi, n)
    blotches = rng.uniform(0.25, 0.85, (n, 4, 4, 3)).astype(np.float32)
    dark = rng.uniform(0.0, 0.15, n).astype(np.float32)
    color_noise = rng.normal(0.0, 1.0, (n, 3))
    period = rng.integers(3, 5, n)
    cell_order = np.argsort(rng.random((n, MAX_OBJECTS)), axis=1)  # which grid cells the objects take
    radius = np.where(counts == 1, rng.uniform(0.22, 0.34, n), rng.uniform(0.13, 0.19, n))
    single_centre = 0.5 + rng.uniform(-0.8, 0.8, (2, n)) * (0.5 - radius)
    cell_jitter = rng.uniform(-0.05, 0.05, (MAX_OBJECTS, 2, n))
    pixel_noise = rng.standard_normal((n, size, size, 3), dtype=np.float32)

    styles = np.asarray(STYLES)[style_ids]
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size
    yy, xx = np.meshgrid(coords, coords, indexing="ij")
    images = np.broadcast_to(gray[:, None, None, None], (n, size, size, 3)).copy()
    for i in np.flatnonzero(styles == "gradient"):
        ramp = np.cos(direction[i]) * (xx - 0.5) + np.sin(direction[i]) * (yy - 0.5)
        images[i] += 0.5 * ramp[..., None]
    textured = styles == "textured"
    cell = -(-size // 4)
    images[textured] = blotches[textured].repeat(cell, 1).repeat(cell, 2)[:, :size, :size]
    sketch = styles == "sketch"
    images[sketch] = dark[sketch, None, None, None]

    jitter = np.where(styles == "noisy", 0.12, 0.04)[:, None]
    palette = np.asarray([COLOR_RGB[c] for c in COLORS]) / 255.0
    paint = np.clip(palette[color_ids] + color_noise * jitter, 0, 1).astype(np.float32)[:, None, None, :]
    pixel_y, pixel_x = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    stripes = ((pixel_x + pixel_y)[None] // period[:, None, None]) % 2 == 1
    checks = ((pixel_x[None] // period[:, None, None]) + (pixel_y[None] // period[:, None, None])) % 2 == 1
    texture = texture_ids[:, None, None]
    dimmed = np.where(texture == 1, stripes, np.where(texture == 2, checks, False))
    dimmed &= ~sketch[:, None, None]  # sketches have no fill

    for slot in range(MAX_OBJECTS):
        for shape_id, shape in enumerate(SHAPES):
            idx = np.flatnonzero((counts > slot) & (shape_ids == shape_id))
            if not len(idx):
                continue
            slot_cell = cell_order[idx, slot]
            grid_x = 0.25 + 0.5 * (slot_cell % 2) + cell_jitter[slot, 0, idx]
            grid_y = 0.25 + 0.5 * (slot_cell // 2) + cell_jitter[slot, 1, idx]
            cx = np.where(counts[idx] == 1, single_centre[0, idx], grid_x).astype(np.float32)
            cy = np.where(counts[idx] == 1, single_centre[1, idx], grid_y).astype(np.float32)
            r = radius[idx, None, None].astype(np.float32)
            mask = _SHAPE_MASKS[shape]((xx - cx[:, None, None]) / r, (yy - cy[:, None, None]) / r)
            inner = mask & np.roll(mask, 1, 1) & np.roll(mask, -1, 1) & np.roll(mask, 1, 2) & np.roll(mask, -1, 2)
            mask &= ~(inner & sketch[idx, None, None])  # sketches keep only the outline
            colour = paint[idx] * np.where(dimmed[idx], 0.45, 1.0)[..., None]
            images[idx] = np.where(mask[..., None], colour, images[idx])

    noise = np.where(styles == "noisy", 0.15, 0.02).astype(np.float32)[:, None, None, None]
    images += pixel_noise * noise
    return np.round(np.clip(images, 0, 1) * 255).astype(np.uint8)


def class_ids(classes: Sequence[str]) -> np.ndarray:
    """The ids in :data:`CLASSES` of ``classes`` (one sentence for an unknown or no class)."""
    unknown = [name for name in classes if name not in CLASSES]
    if unknown:
        raise choice_error("classes", unknown[0], CLASSES)
    if not classes:
        raise ConfigError("classes = () is empty; give at least one 'color shape' class name.")
    return np.asarray([CLASSES.index(name) for name in classes])


def style_ids(styles: Sequence[str]) -> np.ndarray:
    """The ids in :data:`STYLES` of ``styles`` (one sentence for an unknown or no style)."""
    unknown = [name for name in styles if name not in STYLES]
    if unknown:
        raise choice_error("styles", unknown[0], STYLES)
    if not styles:
        raise ConfigError(f"styles = () is empty; give at least one of {', '.join(STYLES)}.")
    return np.asarray([STYLES.index(name) for name in styles])


def draw_objects(n: int, rng: np.random.Generator, distribution: Distribution) -> dict[str, np.ndarray]:
    """Class, shape, colour, texture and style ids of ``n`` images drawn from ``distribution``."""
    drawn_classes = class_ids(distribution.classes)[rng.integers(0, len(distribution.classes), n)]
    drawn_styles = style_ids(distribution.styles)[rng.integers(0, len(distribution.styles), n)]
    return {
        "class": drawn_classes, "shape": drawn_classes // len(COLORS), "color": drawn_classes % len(COLORS),
        "texture": rng.integers(0, len(TEXTURES), n), "style": drawn_styles,
    }  # fmt: skip


def object_columns(objects: dict[str, np.ndarray], counts: np.ndarray, images: np.ndarray) -> dict[str, Any]:
    """The columns of rendered images of ``objects`` (:func:`draw_objects`), ``counts[i]`` objects in image i."""
    return {
        "image": images,
        "domain": [STYLES[i] for i in objects["style"]],
        "shape": [SHAPES[i] for i in objects["shape"]],
        "color": [COLORS[i] for i in objects["color"]],
        "texture": [TEXTURES[i] for i in objects["texture"]],
        "count": counts.astype(np.int64),
    }
