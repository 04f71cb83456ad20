"""What the families share: configurations cut to fewer layers, size checks, quiet loading, text and image
settings read from a model."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rayfed.errors import choice_error
from rayfed.lazy import DeferredModule

transformers = DeferredModule("transformers")


def _with_layers(sizes: Mapping[str, Any], layers: int | None) -> dict[str, Any]:
    return {**sizes, **({} if layers is None else {"num_hidden_layers": layers})}


@dataclass(frozen=True)
class PaperModel:
    """A paper-size backbone's HF configuration and its offline processor (tokenizer and image processor)."""

    config: Any
    processor: Any


def _paper_size(family: str, size: str, sizes: Collection[str]) -> None:
    if size not in sizes:
        raise choice_error("model.backbone", f"{family}:{size}", [f"{family}:{s}" for s in sizes])

@contextlib.contextmanager
def _quiet_loading():
    """No per-weight progress bar or unused-key table from transformers while a backbone loads (every actor
    loads one, and a task model's unused pretraining heads are expected)."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()

def weights_dtype(on_gpu: torch.dtype | str, device: torch.device | str | None = None) -> torch.dtype | str:
    """What a backbone's frozen weights are stored in: ``on_gpu`` where ``device`` is a GPU (default: where this
    process sees one), whose steps compute in bf16 under autocast anyway, else float32 (a CPU runs no autocast here,
    and a float32 LoRA over half-precision weights would need it). ``on_gpu``: bfloat16 for the randomly initialised
    LLMs, as their checkpoints ship; ``"auto"`` for a hub checkpoint, the dtype it ships in."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return on_gpu if torch.device(device).type == "cuda" else torch.float32


def _image_normalization(name_or_path: str) -> dict[str, Any]:
    """The saved image processor's mean and std (0.5, 0.5 when there is none; a hub name: its processor's)."""
    for file, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = Path(name_or_path) / file
        if path.is_file():
            saved = json.loads(path.read_text())
            saved = saved.get(section, {}) if section else saved
            if "image_mean" in saved:
                return {"image_mean": tuple(saved["image_mean"]), "image_std": tuple(saved["image_std"])}
    if not Path(name_or_path).is_dir():
        try:
            processor = transformers.AutoImageProcessor.from_pretrained(name_or_path)
            return {"image_mean": tuple(processor.image_mean), "image_std": tuple(processor.image_std)}
        except (OSError, ValueError, AttributeError):
            pass
    return {}


# What a tokenizer saved without a limit reports as its model_max_length (transformers' VERY_LARGE_INTEGER).
_NO_TOKENIZER_LIMIT = int(1e30)


def _text_limit(tokenizer: Any, positions: int) -> int:
    """The most tokens a text may have: the model's positions, or its tokenizer's ``model_max_length`` where that is
    smaller (and not transformers' "no limit" value)."""
    stated = int(getattr(tokenizer, "model_max_length", 0) or 0)
    return min(stated, positions) if 0 < stated < _NO_TOKENIZER_LIMIT else positions
