"""TAP's text datasets by name, with the paper's input templates (Table 23 of *TAP: Two-Stage Adaptive
Personalization of Multi-Task and Multi-Modal Foundation Models in Federated Learning*, arXiv 2509.26524;
docs/tap.md#data-and-metrics): the data source ``tap:``."""

from __future__ import annotations

from typing import Any

import numpy as np

from rayfed.data.sources import ArrayDataset, SourceRequest
from rayfed.errors import ConfigError
from rayfed.registry import register_source

TAP_DATASETS: dict[str, tuple[str, str]] = {  # recipe -> (hub name, default split)
    "ag_news": ("sh0416/ag_news", "train"),
    "mmlu": ("cais/mmlu", "test"),  # the paper trains on MMLU's test split and tests on its validation split
    "vqav2": ("merve/vqav2-small", "validation"),
    "common_gen": ("allenai/common_gen", "train"),
}
AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
# The subject word of an MMLU prompt: the authors' code names its three subjects "law", "medicine" and "ethics"
# (Table 23's {SUBJECT}); any other subject is its own name in words.
MMLU_SUBJECT_WORDS = {"professional_law": "law", "professional_medicine": "medicine", "moral_scenarios": "ethics"}


def _rgb(image: Any, size: int | None) -> np.ndarray:
    from PIL import Image

    image = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
    image = image.convert("RGB")
    if size is not None and image.size != (size, size):
        image = image.resize((size, size), Image.BILINEAR)
    return np.asarray(image, dtype=np.float32) / 255.0


def _lettered(items: list[str]) -> str:
    """``A. first B. second ...``: the authors' code letters MMLU's options and CommonGen's concepts alike."""
    return " ".join(f"{chr(ord('A') + index)}. {item}" for index, item in enumerate(items))


def tap_columns(recipe: str, rows: Any, subset: str = "", image_size: int | None = 64) -> dict[str, Any]:
    """The columns of one of :data:`TAP_DATASETS` (a ``datasets.Dataset``) in the paper's form."""
    if recipe == "ag_news":  # title + "\n" + description; labels 1..4 -> 0..3
        text = [f"{title}\n{description}" for title, description in zip(rows["title"], rows["description"])]
        return {"text": text, "label": np.asarray(rows["label"], np.int64) - 1, "class_names": AG_NEWS_CLASSES}
    if recipe == "mmlu":
        text, target = [], []
        for question, subject, choices, answer in zip(rows["question"], rows["subject"], rows["choices"],
                                                      rows["answer"]):
            subject = subject or subset
            subject = MMLU_SUBJECT_WORDS.get(subject, subject.replace("_", " "))
            options = _lettered(choices)
            text.append(f"The following is a multiple-choice question about {subject}. Choose the correct answer from "
                        f"the options below. Question: {question} Options: {options}")
            target.append(f"Correct answer on {subject}: {'ABCD'[answer]}. {choices[answer]}")
        return {"text": text, "target": target}
    if recipe == "vqav2":
        return {"image": np.stack([_rgb(image, image_size) for image in rows["image"]]),
                "text": [f"Answer the question based on the image. Question: {q}" for q in rows["question"]],
                "target": [f"Answer: {a}" for a in rows["multiple_choice_answer"]]}
    if recipe == "common_gen":
        return {"text": [f"Generate an appropriate description from the concepts below. Concepts: {_lettered(c)}"
                         for c in rows["concepts"]],
                "target": [f"Description: {t}" for t in rows["target"]]}
    raise ConfigError(f"tap:{recipe} is not a TAP dataset; allowed: {', '.join('tap:' + r for r in TAP_DATASETS)}.")


@register_source("tap:")
def tap_dataset(request: SourceRequest) -> ArrayDataset:
    """TAP's text datasets with the paper's templates (Table 23): ``tap:ag_news``, ``tap:mmlu/<subject>`` (e.g.
    professional_law), ``tap:vqav2`` (images at ``data.options.image_size``, 64) and ``tap:common_gen``, from the
    hub or a ``save_to_disk`` folder (``data.path``)."""
    import datasets

    recipe, _, subset = (request.argument or "").partition("/")
    if recipe not in TAP_DATASETS:
        raise ConfigError(f"data.source = {request.name!r} names no TAP dataset; allowed: "
                          f"{', '.join('tap:' + r for r in TAP_DATASETS)} (tap:mmlu/<subject>).")
    hub, split = TAP_DATASETS[recipe]
    config = request.config
    options = request.options
    unknown = [key for key in options if key != "image_size"]
    if unknown:
        raise ConfigError(f"data.options has no option {unknown[0]!r} for {request.name!r}; allowed: image_size.")
    if config.path is not None:
        loaded = datasets.load_from_disk(config.path)
    else:
        loaded = datasets.load_dataset(hub, subset or None, split=config.split or split)
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded[config.split or split]
    columns = tap_columns(recipe, loaded[:], subset, options.get("image_size", 64))
    return ArrayDataset(images=columns.get("image"), labels=columns.get("label"),
                        class_names=columns.get("class_names", ()),
                        text=np.asarray(columns["text"], dtype=object),
                        target=None if "target" not in columns else np.asarray(columns["target"], dtype=object))
