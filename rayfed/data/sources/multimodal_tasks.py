"""The synthetic multi-modal tasks of :mod:`rayfed.data.multimodal` as sources: ``multimodal:<task>``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from rayfed.data.sources.common import require_no_split, _strings, generator_options, non_negative
from rayfed.data.sources.dataset import ArrayDataset, DataError, SourceRequest
from rayfed.errors import ConfigError, suggest
from rayfed.registry import register_source

_MULTIMODAL_DEFAULTS: dict[str, Any] = {
    "num_samples": 2000, "image_size": 32, "styles": None, "classes": None, "question_types": None,
    "subjects": None, "label_noise": 0.0, "scenes": 0, "scene_classes": 16, "wording": 0, "subsets": None,
}  # fmt: skip
MULTIMODAL_GROUP_COLUMNS = ("domain", "question_type", "scene", "shape", "color", "subset")
_SUBSET_OPTIONS = ("num_samples", "styles", "classes", "question_types", "wording")
_PURPOSE_SCENES = 1003
_PURPOSE_SUBSETS = 1004


@register_source("multimodal:")
def _make_multimodal(request: SourceRequest) -> ArrayDataset:
    """Synthetic multi-modal tasks (:mod:`rayfed.data.multimodal`): ``multimodal:vqa`` (image + question ->
    answer), ``shapes`` (image -> class, or its caption), ``topics`` (text -> topic), ``description``
    (concepts -> description), ``multiple-choice`` (question -> one of 4 options), ``statements`` (text).

    Group columns for the partitioners (heterogeneity): ``domain`` (render style, or a text task's topic
    or subject), ``question_type`` (VQA's function), ``scene`` (with ``scenes: N``: N scenes, each with its
    own background style and its own ``scene_classes`` object classes), ``shape``, ``color``, and ``subset``
    (VQA with ``subsets: [{styles, classes, question_types, wording, num_samples}, ...]``: one dataset per
    entry, e.g. one per client with its own visual style and question phrasing). ``wording: k`` asks VQA's
    image questions in their k-th other phrasing; ``question_types`` may add ``knowledge`` and ``arithmetic``.
    """
    from rayfed.data import multimodal

    task = request.argument or ""
    if task not in multimodal.TASKS:
        raise DataError(f"data.source = {request.name!r} names no generator{suggest(task, multimodal.TASKS)}; "
                        f"allowed: {', '.join('multimodal:' + t for t in multimodal.TASKS)}.")
    require_no_split(request.name, request.config.split)
    group_column = request.config.partition.column
    if group_column is not None and group_column not in MULTIMODAL_GROUP_COLUMNS:
        raise DataError(f"data.partition.column = {group_column!r} is not a column of {request.name!r}"
                        f"{suggest(group_column, MULTIMODAL_GROUP_COLUMNS)}; "
                        f"allowed: {', '.join(MULTIMODAL_GROUP_COLUMNS)}.")
    params = generator_options(request.options, _MULTIMODAL_DEFAULTS, f" for {request.name!r}",
                               ("num_samples", "image_size", "scene_classes"))
    options = {key: tuple(params[key]) for key in ("question_types", "subjects") if params[key] is not None}
    if params["label_noise"]:
        options["label_noise"] = non_negative(params, "label_noise")
    if params["wording"]:
        _require_vqa(task, "wording")
        options["wording"] = params["wording"]
    classes = tuple(params["classes"] or multimodal.CLASSES)
    styles = tuple(params["styles"] or multimodal.FINETUNE_STYLES)
    try:
        if params["subsets"] is not None:
            if params["scenes"]:
                raise DataError("data.options.subsets and data.options.scenes are both set; keep one.")
            columns = _subsets(task, params["subsets"], params, classes, styles, request.seed, options)
        elif params["scenes"]:
            columns = _scenes(task, params, classes, styles, request.seed, options)
        else:
            if task in ("shapes", "vqa", "description"):
                options["distribution"] = multimodal.Distribution(classes, styles, (task,))
            columns = multimodal.columns(task, params["num_samples"], seed=request.seed,
                                         image_size=params["image_size"], **options)
    except ConfigError as err:  # the generators name their own arguments: point at data.options
        raise DataError(f"data.options.{str(err)}") from None
    return _multimodal_dataset(task, columns, group_column)


def _scenes(task: str, params: dict[str, Any], classes: tuple[str, ...], styles: tuple[str, ...], seed: int,
            options: dict[str, Any]) -> dict[str, Any]:
    """``scenes`` image datasets, each from its own background style and subset of classes, concatenated."""
    from rayfed.data import multimodal

    if task not in ("shapes", "vqa"):
        raise DataError(
            f"data.options.scenes applies to image tasks (multimodal:shapes, multimodal:vqa), not {task!r}."
        )
    scenes, per_scene = int(params["scenes"]), params["scene_classes"]
    if per_scene > len(classes):
        raise DataError(f"data.options.scene_classes = {per_scene} is more than the {len(classes)} classes.")
    rng = np.random.default_rng(np.random.SeedSequence([seed, _PURPOSE_SCENES]))
    parts = []
    for scene, count in enumerate(np.array_split(np.arange(params["num_samples"]), scenes)):
        chosen = tuple(classes[k] for k in np.sort(rng.choice(len(classes), per_scene, replace=False)))
        distribution = multimodal.Distribution(chosen, (styles[scene % len(styles)],), (task,))
        scene_seed = int(np.random.SeedSequence([seed, _PURPOSE_SCENES, scene]).generate_state(1)[0])
        part = multimodal.columns(task, len(count), seed=scene_seed, image_size=params["image_size"],
                                  distribution=distribution, **options)
        part["scene"] = np.full(len(count), scene, dtype=np.int64)
        parts.append(part)
    return {key: np.concatenate([np.asarray(part[key]) for part in parts]) for key in parts[0] if key != "choices"}


def _require_vqa(task: str, option: str) -> None:
    if task != "vqa":
        raise DataError(f"data.options.{option} applies to multimodal:vqa only, not multimodal:{task}.")


def _subsets(task: str, subsets: Any, params: dict[str, Any], classes: tuple[str, ...], styles: tuple[str, ...],
             seed: int, options: dict[str, Any]) -> dict[str, Any]:
    """One VQA dataset per entry of ``subsets`` (each its own ``num_samples``, styles, classes, question types and
    wording over the source-wide ones), from a seed of its own, concatenated; column ``subset`` = its index."""
    from rayfed.data import multimodal

    _require_vqa(task, "subsets")
    if not isinstance(subsets, (list, tuple)) or not subsets or not all(isinstance(e, Mapping) for e in subsets):
        raise DataError(f"data.options.subsets = {subsets!r} is invalid: it must be a non-empty list of mappings "
                        f"with any of {', '.join(_SUBSET_OPTIONS)}.")
    parts = []
    for index, entry in enumerate(subsets):
        unknown = [key for key in entry if key not in _SUBSET_OPTIONS]
        if unknown:
            raise DataError(f"data.options.subsets[{index}] has no option {unknown[0]!r}"
                            f"{suggest(unknown[0], _SUBSET_OPTIONS)}; allowed: {', '.join(_SUBSET_OPTIONS)}.")
        count = entry.get("num_samples", params["num_samples"])
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise DataError(f"data.options.subsets[{index}].num_samples = {count!r} is invalid: it must be an "
                            "integer >= 1.")
        part_options = dict(options)
        for key in ("question_types", "wording"):
            if key in entry:
                part_options[key] = tuple(entry[key]) if key == "question_types" else entry[key]
        distribution = multimodal.Distribution(tuple(entry.get("classes", classes)), tuple(entry.get("styles", styles)),
                                               (task,))
        part_seed = int(np.random.SeedSequence([seed, _PURPOSE_SUBSETS, index]).generate_state(1)[0])
        try:
            part = multimodal.columns(task, count, seed=part_seed, image_size=params["image_size"],
                                      distribution=distribution, **part_options)
        except ConfigError as err:
            raise DataError(f"data.options.subsets[{index}].{str(err)}") from None
        part["subset"] = np.full(count, index, dtype=np.int64)
        parts.append(part)
    return {key: np.concatenate([np.asarray(part[key]) for part in parts]) for key in parts[0] if key != "choices"}


def _multimodal_dataset(task: str, columns: dict[str, Any], group_column: str | None) -> ArrayDataset:
    from rayfed.data import multimodal

    images = None
    if task in ("shapes", "vqa"):
        images = np.asarray(columns["image"]).astype(np.float32) / 255.0
    labels, class_names, choices, text = None, (), None, _strings(columns["text"])
    if task == "shapes":
        labels = np.asarray(columns["label"], np.int64)
        class_names, text = multimodal.CLASSES, None  # the caption names the class: it is a target, not an input
    elif task == "vqa":
        labels, class_names = np.asarray(columns["label"], np.int64), multimodal.VQA_ANSWERS
    elif task == "topics":
        labels, class_names = np.asarray(columns["label"], np.int64), tuple(multimodal.TOPICS)
    elif task == "multiple-choice":
        labels, class_names = np.asarray(columns["label"], np.int64), ("A", "B", "C", "D")
        choices = np.asarray(columns["choices"], dtype=object)
    target = _strings(columns["text"] if task == "shapes" else columns["target"])
    if task == "statements":
        text, target = _strings([""] * len(columns["text"])), _strings(columns["text"])
    groups, domains = None, ()
    if group_column is not None:
        values = np.asarray(columns[group_column])
        domains_found, groups = np.unique(values, return_inverse=True)
        domains, groups = tuple(str(v) for v in domains_found), groups.astype(np.int64).reshape(-1)
    return ArrayDataset(images, labels, class_names, groups, text=text, target=target, choices=choices, domains=domains)
