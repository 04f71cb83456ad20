"""How a backbone's own image processor resizes and crops an image (``data.resize: backbone``), read from the
backbone's saved configuration without loading its weights: a transformers image processor
(``preprocessor_config.json`` or ``processor_config.json`` of a model folder or hub name) or an open_clip model's
image size and preprocessing (its model and pretrained configs). Normalization is not here: the client model
normalizes the [0, 1] pixels it is given."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from rayfed.errors import ConfigError
from rayfed.lazy import DeferredModule

if TYPE_CHECKING:
    from PIL.Image import Image

    from rayfed.config import ModelConfig

transformers = DeferredModule("transformers")
open_clip = DeferredModule("open_clip")

_PIL_FILTERS = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


@dataclass(frozen=True)
class ImagePreprocessing:
    """A backbone processor's geometry: resize, then center crop, the image converted to RGB first."""

    size: int | tuple[int, int] | None  # int: the shortest edge resized to it; (height, width): resized to that
    crop: tuple[int, int] | None  # the (height, width) cut from the center after resizing
    resample: int  # the PIL filter of the resize (PIL.Image.Resampling)
    # the crop's offset: transformers' (size - crop) // 2, or torchvision's round((size - crop) / 2)
    crop_offset: Literal["floor", "round"] = "floor"
    alpha: Literal["white", "drop"] = "white"  # transparency: composited onto white (transformers) or dropped (PIL)
    source: str = field(default="", compare=False)  # the backbone it was read from, for messages

    @property
    def output_size(self) -> tuple[int, int] | None:
        """Every image's (height, width) after processing; None where it follows the image's own shape."""
        return self.crop if self.crop is not None else self.size if isinstance(self.size, tuple) else None

    def apply(self, image: Image) -> Image:
        """``image`` resized and cropped as the backbone's processor does (RGB)."""
        from PIL import Image as pil

        if self.alpha == "white" and ("A" in image.getbands() or "transparency" in image.info):
            image = pil.alpha_composite(pil.new("RGBA", image.size, (255, 255, 255, 255)), image.convert("RGBA"))
        image = image.convert("RGB")
        width, height = image.size
        if isinstance(self.size, int):  # the shortest edge to size, the other in proportion (rounded down)
            short, long = sorted((width, height))
            resized = (self.size, int(self.size * long / short))
            width, height = resized if width <= height else resized[::-1]
            image = image.resize((width, height), self.resample)
        elif self.size is not None:
            height, width = self.size
            image = image.resize((width, height), self.resample)
        if self.crop is None:
            return image
        crop_height, crop_width = self.crop
        offset = (lambda extra: extra // 2) if self.crop_offset == "floor" else (lambda extra: int(round(extra / 2.0)))
        top, left = offset(height - crop_height), offset(width - crop_width)
        return image.crop((left, top, left + crop_width, top + crop_height))  # outside the image: zeros


def image_preprocessing(model: ModelConfig) -> ImagePreprocessing:
    """The resize and crop of ``model.backbone``'s own image processor; one sentence where it has none this reads."""
    from rayfed import zoo

    backbone = model.backbone if isinstance(model.backbone, str) else None
    prefix, _, argument = (backbone or "").partition(":")
    if prefix == "hf" and argument:
        return _transformers_processor(argument, backbone)
    if prefix == "tiny-pretrained" and argument in zoo.FAMILIES:
        folder = str(zoo.pretrained(argument))
        if os.path.isfile(os.path.join(folder, "open_clip_config.json")):
            return _open_clip_folder(folder, backbone)
        return _transformers_processor(folder, backbone)
    if prefix == "open_clip" and argument:
        return _open_clip_builtin(argument, model.pretrained, backbone)
    shown = backbone if backbone is not None else getattr(model.backbone, "__name__", repr(model.backbone))
    raise ConfigError(
        f"data.resize = 'backbone' needs a backbone with a saved image processor (hf:<model>, open_clip:<arch>, "
        f"tiny-pretrained:<family>), but model.backbone = {shown!r}; set data.resize to a size (e.g. 224)."
    )


def _transformers_processor(name_or_path: str, shown_as: str) -> ImagePreprocessing:
    try:
        processor = transformers.AutoImageProcessor.from_pretrained(name_or_path)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"data.resize = 'backbone' could not read the image processor of model.backbone = "
                          f"{shown_as!r} ({str(err).splitlines()[0]}); set data.resize to a size (e.g. 224).") from None
    size = _size(processor.size, shown_as) if getattr(processor, "do_resize", True) else None
    crop = None
    if getattr(processor, "do_center_crop", False):
        crop = _size(processor.crop_size, shown_as)
        crop = crop if isinstance(crop, tuple) else (crop, crop)
    found = ImagePreprocessing(size, crop, int(getattr(processor, "resample", 3)), "floor", "white", shown_as)
    _require_one_size(found)
    return found


def _size(size: Any, shown_as: str) -> int | tuple[int, int]:
    """A processor's size (a dict, or transformers 5's SizeDict) as a shortest edge or a (height, width)."""
    def read(key: str) -> Any:
        return size.get(key) if isinstance(size, dict) else getattr(size, key, None)

    if isinstance(size, int):
        return size
    if read("height") is not None and read("width") is not None:
        return int(read("height")), int(read("width"))
    if read("shortest_edge") is not None and read("longest_edge") is None:
        return int(read("shortest_edge"))
    raise ConfigError(
        f"model.backbone = {shown_as!r} resizes images by {size!r}, which data.resize = 'backbone' does not follow "
        "(it follows a shortest edge or a height and width); set data.resize to a size (e.g. 224)."
    )


def _open_clip_builtin(arch: str, pretrained: str | None, shown_as: str) -> ImagePreprocessing:
    config = open_clip.get_model_config(arch)
    if config is None:
        raise ConfigError(f"data.resize = 'backbone' found no open_clip model {arch!r} "
                          f"(model.backbone = {shown_as!r}); set data.resize to a size (e.g. 224).")
    tag = open_clip.get_pretrained_cfg(arch, pretrained) if pretrained and not os.path.isfile(pretrained) else {}
    return _open_clip(config, {**config.get("preprocess_cfg", {}), **tag}, shown_as)


def _open_clip_folder(folder: str, shown_as: str) -> ImagePreprocessing:
    with open(os.path.join(folder, "open_clip_config.json")) as file:
        config = json.load(file)
    return _open_clip(config["model_cfg"], config.get("preprocess_cfg", {}), shown_as)


def _open_clip(model_cfg: dict[str, Any], preprocess: dict[str, Any], shown_as: str) -> ImagePreprocessing:
    """open_clip's evaluation transform: ``shortest`` resizes the shortest edge and center-crops the square (rounding
    the offset as torchvision does), ``squash`` resizes to the square; transparency is dropped (PIL's convert)."""
    size = preprocess.get("size", model_cfg["vision_cfg"]["image_size"])
    height, width = size if isinstance(size, (tuple, list)) else (size, size)
    mode, interpolation = preprocess.get("resize_mode", "shortest"), preprocess.get("interpolation", "bicubic")
    if (mode not in ("shortest", "squash") or (mode == "shortest" and height != width)
            or interpolation not in _PIL_FILTERS):
        raise ConfigError(
            f"model.backbone = {shown_as!r} preprocesses with resize_mode {mode!r} at {height}x{width} "
            f"({interpolation}), which data.resize = 'backbone' does not follow; set data.resize to a size (e.g. 224)."
        )
    resample = _PIL_FILTERS[interpolation]
    if mode == "squash":
        return ImagePreprocessing((int(height), int(width)), None, resample, "round", "drop", shown_as)
    return ImagePreprocessing(int(height), (int(height), int(width)), resample, "round", "drop", shown_as)


def _require_one_size(found: ImagePreprocessing) -> None:
    if found.output_size is None:
        raise ConfigError(
            f"model.backbone = {found.source!r} resizes each image's shortest edge to {found.size} without a crop, so "
            f"images of different shapes keep different sizes; set data.resize to a size (e.g. {found.size})."
        )
