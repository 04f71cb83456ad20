"""Deterministic synthetic multi-modal, multi-task data: shape images, captions, VQA, topic texts and
text generation, as ``datasets.Dataset`` objects.

Every generator returns the same columns (:func:`features`), so datasets of different tasks can be
concatenated into one multi-task client: ``image`` (uint8 ``(S, S, 3)``, ``None`` for text-only
tasks), ``text`` (caption, question or input text), ``target`` (answer or output text), ``label``
(class id within the task, -1 if none), ``class_name``, ``task``, ``modality`` (``image``,
``text`` or ``image+text``), ``domain`` (render style for images; topic or subject for texts) and
the object attributes ``shape``, ``color``, ``texture``, ``count``.

Pretraining and federated fine-tuning draw from different distributions (:data:`PRETRAIN`,
:data:`FINETUNE`): images of pretraining use the styles "plain" and "gradient" and only the 48
:data:`SEEN_CLASSES`; fine-tuning images use the held-out styles "textured", "noisy" and "sketch" and
all 64 classes, 16 of which (:data:`NOVEL_CLASSES`) no pretrained model has seen. Text models pretrain
on plain statements (the ``statements`` task); the fine-tuning text tasks (topic labels, descriptions,
multiple-choice answers) and their output formats never occur in pretraining.

The images, their classes and render styles are :mod:`rayfed.data.shape_scenes`'; the words (templates, questions,
facts, the vocabulary) :mod:`rayfed.data.multimodal_texts`'.

Same arguments and seed give the same dataset, bit for bit.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

# The image vocabulary, classes and Distribution are shape_scenes'; importable from here too.
from rayfed.data.shape_scenes import (  # noqa: F401
    CLASSES, COLORS, FINETUNE_STYLES, MAX_OBJECTS, NOVEL_CLASSES, PRETRAIN_STYLES, SEEN_CLASSES, SHAPES, STYLES,
    TEXTURES, Distribution, draw_objects, object_columns, render,
)
# The words (templates, questions, facts, vocabulary) are multimodal_texts'; importable from here too.
from rayfed.data.multimodal_texts import (  # noqa: F401
    ALL_QUESTION_TYPES, CLASS_PROMPT, EXTRA_QUESTION_TYPES, LETTERS, NUMBERS, QUESTION_TYPES, SUBJECTS, TOPICS,
    VQA_ANSWERS, VQA_QUESTIONS, VQA_WORDINGS, class_prompts, draw_captions, subject_facts, topic_sentences,
    vocabulary,
)
from rayfed.errors import ConfigError, choice_error
from rayfed.lazy import DeferredModule

datasets = DeferredModule("datasets")

VERSION = 1  # bump when the same arguments generate different samples (pretrained models then rebuild)

TASKS = ("shapes", "vqa", "topics", "description", "multiple-choice", "statements")
_MODALITY = {"shapes": "image+text", "vqa": "image+text", "topics": "text", "description": "text",
             "multiple-choice": "text", "statements": "text"}  # fmt: skip


PRETRAIN = Distribution(SEEN_CLASSES, PRETRAIN_STYLES, ("shapes", "statements"))
FINETUNE = Distribution(CLASSES, FINETUNE_STYLES, ("shapes", "vqa", "topics", "description", "multiple-choice"))


def features(image_size: int = 32) -> datasets.Features:
    """The columns every generator returns."""
    string, integer = datasets.Value("string"), datasets.Value("int64")
    return datasets.Features({
        "image": datasets.Array3D((image_size, image_size, 3), "uint8"),
        "text": string, "target": string, "label": integer, "class_name": string,
        "task": string, "modality": string, "domain": string, "question_type": string,
        "shape": string, "color": string, "texture": string, "count": integer,
        "choices": datasets.Sequence(string),
    })  # fmt: skip



def _rng(seed: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(purpose.encode())]))


# ---------------------------------------------------------------------------------------------
# Generators: column dicts (numpy images) and datasets.Dataset wrappers


def _columns(n: int, task: str, **values: Any) -> dict[str, Any]:
    """Fill the columns a task does not set with their empty values."""
    columns: dict[str, Any] = {
        "image": [None] * n, "text": [""] * n, "target": [""] * n, "label": np.full(n, -1, np.int64),
        "class_name": [""] * n, "task": [task] * n, "modality": [_MODALITY[task]] * n, "domain": [""] * n,
        "question_type": [""] * n, "shape": [""] * n, "color": [""] * n, "texture": [""] * n,
        "count": np.zeros(n, np.int64), "choices": [[] for _ in range(n)],
    }  # fmt: skip
    columns.update(values)
    return columns



def shape_columns(n: int, *, seed: int, distribution: Distribution = FINETUNE, image_size: int = 32) -> dict[str, Any]:
    """Columns of :func:`shapes` (images as one uint8 array), for code that trains on arrays directly."""
    rng = _rng(seed, "shapes")
    objects = draw_objects(n, rng, distribution)
    counts = np.ones(n, np.int64)
    images = render(objects["shape"], objects["color"], objects["texture"], objects["style"], counts, rng, image_size)
    return _columns(
        n, "shapes", **object_columns(objects, counts, images), text=draw_captions(objects, rng),
        label=objects["class"].astype(np.int64), class_name=[CLASSES[k] for k in objects["class"]],
    )  # fmt: skip


def vqa_columns(
    n: int,
    *,
    seed: int,
    distribution: Distribution = FINETUNE,
    question_types: Sequence[str] = QUESTION_TYPES,
    image_size: int = 32,
    wording: int = 0,
) -> dict[str, Any]:
    """Columns of :func:`vqa`; ``wording`` k > 0 asks each image question in its k-th other wording
    (:data:`VQA_WORDINGS`). The images, objects and question types drawn do not depend on ``wording``, nor on
    whether :data:`EXTRA_QUESTION_TYPES` occur (their facts come from a stream of their own)."""
    unknown = [q for q in question_types if q not in ALL_QUESTION_TYPES]
    if unknown or not question_types:
        raise choice_error("question_types", unknown[0] if unknown else "", ALL_QUESTION_TYPES)
    wordings = 1 + len(VQA_WORDINGS["color"])
    if isinstance(wording, bool) or not isinstance(wording, (int, np.integer)) or not 0 <= wording < wordings:
        raise ConfigError(f"wording = {wording!r} is invalid: it must be an integer in 0..{wordings - 1}.")
    rng = _rng(seed, "vqa")
    objects = draw_objects(n, rng, distribution)
    counts = rng.integers(1, MAX_OBJECTS + 1, n)
    images = render(objects["shape"], objects["color"], objects["texture"], objects["style"], counts, rng, image_size)
    kinds = np.asarray(question_types)[rng.integers(0, len(question_types), n)]
    facts = _extra_questions(kinds, _rng(seed, "vqa:facts"))
    texts, answers = [], []
    for index, (kind, c, s, k) in enumerate(zip(kinds, objects["color"], objects["shape"], counts)):
        if kind in EXTRA_QUESTION_TYPES:
            question, answer = facts[index]
        else:
            question = VQA_QUESTIONS[kind] if wording == 0 else VQA_WORDINGS[kind][wording - 1]
            answer = COLORS[c] if kind == "color" else SHAPES[s] if kind == "shape" else NUMBERS[k - 1]
        texts.append(question)
        answers.append(answer)
    return _columns(
        n, "vqa", **object_columns(objects, counts, images), text=texts,
        target=[f"Answer: {a}" for a in answers], class_name=answers, question_type=[str(k) for k in kinds],
        label=np.asarray([VQA_ANSWERS.index(a) for a in answers], np.int64),
    )  # fmt: skip


def _extra_questions(kinds: np.ndarray, rng: np.random.Generator) -> dict[int, tuple[str, str]]:
    """(question, answer) of each ``knowledge`` or ``arithmetic`` question among ``kinds``, by position."""
    knowledge = [(q, a) for subject in ("colors", "shapes") for q, a, _ in subject_facts(subject)]
    arithmetic = [(q, a) for q, a, _ in subject_facts("numbers") if a in VQA_ANSWERS]  # sums up to four
    pools = {"knowledge": knowledge, "arithmetic": arithmetic}
    return {index: pools[kind][rng.integers(len(pools[kind]))]
            for index, kind in enumerate(kinds) if kind in EXTRA_QUESTION_TYPES}



def topic_columns(n: int, *, seed: int, label_noise: float = 0.0) -> dict[str, Any]:
    """Columns of :func:`topics`."""
    if not 0.0 <= label_noise < 1.0:
        raise ConfigError(f"label_noise = {label_noise} is invalid: it must be in [0, 1).")
    rng = _rng(seed, "topics")
    topic_ids = rng.integers(0, len(TOPICS), n)
    texts = topic_sentences(n, rng, topic_ids)
    flip = rng.random(n) < label_noise
    labels = np.where(flip, (topic_ids + rng.integers(1, len(TOPICS), n)) % len(TOPICS), topic_ids)
    names = [list(TOPICS)[k] for k in labels]
    return _columns(n, "topics", text=texts, label=labels.astype(np.int64), class_name=names, domain=["news"] * n)


def description_columns(n: int, *, seed: int, distribution: Distribution = FINETUNE) -> dict[str, Any]:
    """Columns of :func:`description`."""
    rng = _rng(seed, "description")
    objects = draw_objects(n, rng, distribution)
    texts, targets = [], []
    for c, s, x in zip(objects["color"], objects["shape"], objects["texture"]):
        concepts = [COLORS[c], SHAPES[s], TEXTURES[x]]
        texts.append("Concepts: " + " ".join(concepts[i] for i in rng.permutation(3)))
        targets.append(f"Description: a {TEXTURES[x]} {COLORS[c]} {SHAPES[s]}.")
    return _columns(
        n, "description", text=texts, target=targets, class_name=[CLASSES[k] for k in objects["class"]],
        domain=["concepts"] * n, shape=[SHAPES[s] for s in objects["shape"]],
        color=[COLORS[c] for c in objects["color"]], texture=[TEXTURES[x] for x in objects["texture"]],
    )  # fmt: skip




def multiple_choice_columns(n: int, *, seed: int, subjects: Sequence[str] = SUBJECTS) -> dict[str, Any]:
    """Columns of :func:`multiple_choice`."""
    unknown = [s for s in subjects if s not in SUBJECTS]
    if unknown or not subjects:
        raise choice_error("subjects", unknown[0] if unknown else "", SUBJECTS)
    rng = _rng(seed, "multiple-choice")
    texts, targets, labels, answers, domains, choices = [], [], [], [], [], []
    for subject in np.asarray(subjects)[rng.integers(0, len(subjects), n)]:
        facts = subject_facts(str(subject))
        question, answer, _ = facts[rng.integers(len(facts))]
        distractors = sorted({a for _, a, _ in facts} - {answer})
        options = [distractors[i] for i in rng.permutation(len(distractors))[:3]]
        correct = int(rng.integers(4))
        options.insert(correct, answer)
        listing = " ".join(f"{letter}. {option}" for letter, option in zip(LETTERS, options))
        texts.append(f"Question: {question} Options: {listing}")
        targets.append(f"Correct answer on {subject}: {LETTERS[correct]}. {answer}")
        labels.append(correct)
        answers.append(answer)
        domains.append(str(subject))
        choices.append(options)
    return _columns(
        n, "multiple-choice", text=texts, target=targets, label=np.asarray(labels, np.int64),
        class_name=answers, domain=domains, choices=choices,
    )  # fmt: skip


def statement_columns(n: int, *, seed: int, distribution: Distribution = PRETRAIN) -> dict[str, Any]:
    """Columns of :func:`statements`: a text-only corpus of captions, facts and news sentences."""
    rng = _rng(seed, "statements")
    facts = [statement for subject in SUBJECTS for _, _, statement in subject_facts(subject)]
    kinds = rng.integers(0, 3, n)  # 0: caption of an image class, 1: fact, 2: news sentence
    captions = draw_captions(draw_objects(n, rng, distribution), rng)
    news = topic_sentences(n, rng, rng.integers(0, len(TOPICS), n))
    fact_ids = rng.integers(0, len(facts), n)
    texts = [captions[i] if kind == 0 else facts[fact_ids[i]] if kind == 1 else news[i] for i, kind in enumerate(kinds)]
    domains = [("captions", "facts", "news")[kind] for kind in kinds]
    return _columns(n, "statements", text=texts, domain=domains)


_COLUMN_MAKERS: dict[str, Callable[..., dict[str, Any]]] = {
    "shapes": shape_columns,
    "vqa": vqa_columns,
    "topics": topic_columns,
    "description": description_columns,
    "multiple-choice": multiple_choice_columns,
    "statements": statement_columns,
}


def generate(task: str, n: int, *, seed: int, image_size: int = 32, **options: Any) -> datasets.Dataset:
    """``n`` samples of ``task`` (one of :data:`TASKS`) as a ``datasets.Dataset`` with :func:`features`.

    ``options`` go to the task's column maker (e.g. ``distribution=PRETRAIN``, ``label_noise=0.1``).
    """
    return datasets.Dataset.from_dict(columns(task, n, seed=seed, image_size=image_size, **options),
                                      features=features(image_size))


def columns(task: str, n: int, *, seed: int, image_size: int = 32, **options: Any) -> dict[str, Any]:
    """The columns of :func:`generate` as a dict (images as one uint8 array), without building a Dataset."""
    if task not in _COLUMN_MAKERS:
        raise choice_error("task", task, TASKS)
    if n < 1:
        raise ConfigError(f"n = {n} is invalid: a dataset needs at least one sample.")
    if task in ("shapes", "vqa"):
        options["image_size"] = image_size
    return _COLUMN_MAKERS[task](n, seed=seed, **options)


def shapes(n: int, *, seed: int, distribution: Distribution = FINETUNE, image_size: int = 32) -> datasets.Dataset:
    """Images of one object, its class (``"red circle"``, id in :data:`CLASSES`) and a caption."""
    return generate("shapes", n, seed=seed, distribution=distribution, image_size=image_size)


def vqa(
    n: int,
    *,
    seed: int,
    distribution: Distribution = FINETUNE,
    question_types: Sequence[str] = QUESTION_TYPES,
    image_size: int = 32,
) -> datasets.Dataset:
    """(image of 1-4 identical objects, question, ``"Answer: red"``); label = id in :data:`VQA_ANSWERS`."""
    return generate(
        "vqa", n, seed=seed, distribution=distribution, question_types=question_types, image_size=image_size
    )


def topics(n: int, *, seed: int, label_noise: float = 0.0) -> datasets.Dataset:
    """News-like sentences labelled with one of :data:`TOPICS` (an AG News stand-in)."""
    return generate("topics", n, seed=seed, label_noise=label_noise)


def description(n: int, *, seed: int, distribution: Distribution = FINETUNE) -> datasets.Dataset:
    """``"Concepts: circle red striped"`` -> ``"Description: a striped red circle."`` (a CommonGen stand-in)."""
    return generate("description", n, seed=seed, distribution=distribution)


def multiple_choice(n: int, *, seed: int, subjects: Sequence[str] = SUBJECTS) -> datasets.Dataset:
    """Question with options A-D -> ``"Correct answer on colors: C. red"`` (an MMLU stand-in)."""
    return generate("multiple-choice", n, seed=seed, subjects=subjects)


def statements(n: int, *, seed: int, distribution: Distribution = PRETRAIN) -> datasets.Dataset:
    """The text pretraining corpus: captions of ``distribution``'s classes, facts and news sentences."""
    return generate("statements", n, seed=seed, distribution=distribution)


def multitask(
    counts: Mapping[str, int], *, seed: int, distribution: Distribution = FINETUNE, image_size: int = 32
) -> datasets.Dataset:
    """One dataset holding ``counts[task]`` samples of each task (in the given order), e.g. for a
    multi-task client; image tasks and ``description`` draw from ``distribution``."""
    parts = []
    for task, n in counts.items():
        options: dict[str, Any] = {}
        if task in ("shapes", "vqa", "description", "statements"):
            options["distribution"] = distribution
        parts.append(generate(task, n, seed=seed, image_size=image_size, **options))
    if not parts:
        raise ConfigError("counts = {} names no task; give at least one of " + ", ".join(TASKS) + ".")
    return datasets.concatenate_datasets(parts)


def task_mix(round_idx: int, tasks: Sequence[str], rounds_per_task: int, blend_rounds: int = 0) -> dict[str, float]:
    """The share of each task in round ``round_idx`` of a task stream (tasks arriving one after another).

    Task k is active during rounds ``[k * rounds_per_task, (k + 1) * rounds_per_task)``; over the last
    ``blend_rounds`` rounds of that window the mix moves linearly towards task k + 1. After the last
    window the last task stays.
    """
    if not tasks:
        raise ConfigError("tasks = () is empty; a task stream needs at least one task.")
    if rounds_per_task < 1 or not 0 <= blend_rounds <= rounds_per_task:
        raise ConfigError(
            f"rounds_per_task = {rounds_per_task}, blend_rounds = {blend_rounds} are invalid: "
            "need rounds_per_task >= 1 and 0 <= blend_rounds <= rounds_per_task."
        )
    if round_idx < 0:
        raise ConfigError(f"round_idx = {round_idx} is invalid: rounds count from 0.")
    current = min(round_idx // rounds_per_task, len(tasks) - 1)
    into_window = round_idx - current * rounds_per_task
    blend_start = rounds_per_task - blend_rounds
    mix = {task: 0.0 for task in tasks}
    if current + 1 < len(tasks) and blend_rounds and into_window >= blend_start:
        share_next = (into_window - blend_start + 1) / (blend_rounds + 1)
        mix[tasks[current + 1]] += share_next
        mix[tasks[current]] += 1.0 - share_next
    else:
        mix[tasks[current]] += 1.0
    return mix


def image_array(dataset: datasets.Dataset) -> np.ndarray:
    """The ``image`` column as uint8 ``(N, S, S, 3)``; every row must have an image."""
    modalities = set(dataset["modality"])
    if "text" in modalities:
        raise ConfigError("dataset has text-only rows (modality 'text'); select the image rows before image_array.")
    return np.asarray(dataset.with_format("numpy")[:]["image"], dtype=np.uint8)
