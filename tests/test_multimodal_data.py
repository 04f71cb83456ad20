"""rayfed.data.multimodal: deterministic synthetic multi-modal, multi-task data."""

from __future__ import annotations

import numpy as np
import pytest

from rayfed.data import multimodal as mm
from rayfed.data.shape_scenes import COLOR_RGB
from rayfed.errors import ConfigError

TASK_SIZES = {"shapes": 48, "vqa": 48, "topics": 40, "description": 30, "multiple-choice": 30, "statements": 60}


@pytest.mark.parametrize("task", mm.TASKS)
def test_generators_are_deterministic_by_seed(task: str) -> None:
    n = TASK_SIZES[task]
    first = mm.generate(task, n, seed=7, image_size=16)
    again = mm.generate(task, n, seed=7, image_size=16)
    other = mm.generate(task, n, seed=8, image_size=16)
    assert first.to_dict() == again.to_dict()
    assert first.to_dict() != other.to_dict()


def test_every_task_has_the_shared_columns_and_concatenates() -> None:
    mixed = mm.multitask({task: 12 for task in mm.TASKS}, seed=0, image_size=16)
    assert mixed.features == mm.features(16)
    assert len(mixed) == 12 * len(mm.TASKS)
    for task in mm.TASKS:
        rows = mixed.filter(lambda t: t == task, input_columns="task")
        has_image = mm.generate(task, 1, seed=0, image_size=16)["modality"][0] == "image+text"
        assert all((image is not None) == has_image for image in rows["image"])
        assert len(set(rows["modality"])) == 1
    images = mm.image_array(mixed.filter(lambda m: m == "image+text", input_columns="modality"))
    assert images.dtype == np.uint8 and images.shape == (24, 16, 16, 3)


def test_image_array_refuses_text_rows() -> None:
    with pytest.raises(ConfigError, match="text-only rows"):
        mm.image_array(mm.multitask({"shapes": 2, "topics": 2}, seed=0))


def test_labels_and_metadata_describe_the_images() -> None:
    """A single object in the plain style: its pixels that differ from the background carry its colour."""
    data = mm.shape_columns(64, seed=3, distribution=mm.Distribution(mm.CLASSES, ("plain",), ()))
    palette = np.asarray([COLOR_RGB[c] for c in mm.COLORS], dtype=float)
    for image, color, class_name, label, caption in zip(
        data["image"], data["color"], data["class_name"], data["label"], data["text"]
    ):
        pixels = image.reshape(-1, 3).astype(float)
        background = np.median(pixels, axis=0)
        object_pixels = pixels[np.abs(pixels - background).sum(1) > 60]
        assert len(object_pixels) > 10
        solid = object_pixels[np.argsort(-object_pixels.sum(1))[: len(object_pixels) // 3]]  # undimmed texture cells
        nearest = np.argmin(np.abs(palette[:, None] - solid[None]).sum(-1), axis=0)
        assert mm.COLORS[np.bincount(nearest).argmax()] == color
        assert mm.CLASSES[label] == class_name and color in caption and class_name.split()[1] in caption


def test_vqa_answers_match_the_scene() -> None:
    data = mm.vqa_columns(90, seed=1)
    for question, target, label, color, shape, count in zip(
        data["text"], data["target"], data["label"], data["color"], data["shape"], data["count"]
    ):
        expected = color if "color" in question else shape if "shape" in question else mm.NUMBERS[count - 1]
        assert target == f"Answer: {expected}" and mm.VQA_ANSWERS[label] == expected
    assert set(data["count"]) == {1, 2, 3, 4}
    only_counts = mm.vqa_columns(20, seed=1, question_types=["count"])
    assert all(q == "how many objects are there?" for q in only_counts["text"])


def test_text_tasks_have_their_output_formats() -> None:
    mcq = mm.multiple_choice_columns(50, seed=2)
    for text, target, label, answer, subject in zip(
        mcq["text"], mcq["target"], mcq["label"], mcq["class_name"], mcq["domain"]
    ):
        letter = "ABCD"[label]
        assert target == f"Correct answer on {subject}: {letter}. {answer}"
        assert f"{letter}. {answer}" in text and text.startswith("Question: ")
    description = mm.description_columns(20, seed=2)
    for text, target, color, shape, texture in zip(
        description["text"], description["target"], description["color"], description["shape"], description["texture"]
    ):
        assert sorted(text.removeprefix("Concepts: ").split()) == sorted([color, shape, texture])
        assert target == f"Description: a {texture} {color} {shape}."


def test_topic_labels_and_label_noise() -> None:
    clean = mm.topic_columns(400, seed=4)
    topics = list(mm.TOPICS)
    for text, label in zip(clean["text"], clean["label"]):
        words = set(text.rstrip(".").split())
        assert words & set(mm.TOPICS[topics[label]]) and not any(
            words & set(mm.TOPICS[t]) for t in topics if t != topics[label]
        )
    noisy = mm.topic_columns(400, seed=4, label_noise=0.3)
    flipped = np.mean(np.asarray(noisy["label"]) != np.asarray(clean["label"]))
    assert noisy["text"] == clean["text"] and 0.2 < flipped < 0.4


def test_pretraining_and_finetuning_distributions_are_disjoint() -> None:
    assert not set(mm.PRETRAIN.styles) & set(mm.FINETUNE.styles)
    assert not set(mm.NOVEL_CLASSES) & set(mm.PRETRAIN.classes)
    assert set(mm.NOVEL_CLASSES) <= set(mm.FINETUNE.classes) and len(mm.NOVEL_CLASSES) == 16
    assert not set(mm.PRETRAIN.tasks) - {"shapes", "statements"}
    assert not set(mm.FINETUNE.tasks) & {"statements"}
    # every colour and shape word is seen in pretraining; only the 16 combinations are new
    assert {c.split()[0] for c in mm.SEEN_CLASSES} == set(mm.COLORS)
    assert {c.split()[1] for c in mm.SEEN_CLASSES} == set(mm.SHAPES)

    pretraining = mm.shape_columns(2000, seed=0, distribution=mm.PRETRAIN)
    assert set(pretraining["domain"]) == set(mm.PRETRAIN_STYLES)
    assert not set(pretraining["class_name"]) & set(mm.NOVEL_CLASSES)
    corpus = mm.statement_columns(2000, seed=0)
    assert not any(novel in text for text in corpus["text"] for novel in mm.NOVEL_CLASSES)
    formats = ("Answer:", "Description:", "Concepts:", "Question:", "Correct answer")
    assert not any(marker in text for text in corpus["text"] for marker in formats)

    finetuning = mm.shape_columns(2000, seed=0)
    assert set(finetuning["domain"]) == set(mm.FINETUNE_STYLES)
    assert set(mm.NOVEL_CLASSES) <= set(finetuning["class_name"])


def test_task_mix_moves_through_the_stream() -> None:
    tasks = ["a", "b", "c"]
    assert mm.task_mix(0, tasks, rounds_per_task=5) == {"a": 1.0, "b": 0.0, "c": 0.0}
    assert mm.task_mix(7, tasks, rounds_per_task=5) == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert mm.task_mix(99, tasks, rounds_per_task=5) == {"a": 0.0, "b": 0.0, "c": 1.0}
    blended = [mm.task_mix(r, tasks, rounds_per_task=5, blend_rounds=2) for r in range(5)]
    assert [m["b"] for m in blended] == pytest.approx([0, 0, 0, 1 / 3, 2 / 3])
    assert all(sum(m.values()) == pytest.approx(1.0) for m in blended)
    assert mm.task_mix(14, tasks, rounds_per_task=5, blend_rounds=2) == {"a": 0.0, "b": 0.0, "c": 1.0}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: mm.generate("shape", 4, seed=0), "did you mean 'shapes'"),
        (lambda: mm.shapes(4, seed=0, distribution=mm.Distribution(("red circel",), ("plain",), ())), "red circle"),
        (lambda: mm.shapes(4, seed=0, distribution=mm.Distribution(("red circle",), ("sketchy",), ())), "sketch"),
        (lambda: mm.generate("topics", 0, seed=0), "at least one sample"),
        (lambda: mm.topics(4, seed=0, label_noise=1.5), "label_noise"),
        (lambda: mm.vqa(4, seed=0, question_types=["size"]), "question_types"),
        (lambda: mm.multiple_choice(4, seed=0, subjects=["history"]), "subjects"),
        (lambda: mm.task_mix(0, [], rounds_per_task=5), "at least one task"),
        (lambda: mm.task_mix(0, ["a"], rounds_per_task=2, blend_rounds=3), "blend_rounds"),
    ],
)
def test_bad_arguments_get_one_clear_sentence(call, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()
