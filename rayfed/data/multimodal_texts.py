"""The words of the synthetic multi-modal data (:mod:`rayfed.data.multimodal`): caption templates, VQA questions and
their other wordings, news topics, the multiple-choice subjects' facts, the output formats, and the vocabulary of
every word the generators can emit (:func:`vocabulary`, which the offline tokenizers are built on).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from rayfed.data.shape_scenes import CLASSES, COLORS, MAX_OBJECTS, SHAPES, STYLES, TEXTURES

NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight")

TOPICS = {  # 8 nouns, then 4 verbs
    "sports": ("team", "match", "coach", "goal", "season", "player", "league", "stadium",
               "won", "scored", "trained", "defeated"),
    "science": ("researchers", "study", "cells", "planet", "energy", "experiment", "telescope", "genes",
                "discovered", "measured", "observed", "tested"),
    "business": ("company", "market", "shares", "profit", "bank", "investors", "prices", "sales",
                 "rose", "reported", "bought", "sold"),
    "world": ("leaders", "government", "election", "border", "minister", "treaty", "capital", "protest",
              "agreed", "announced", "visited", "signed"),
}  # fmt: skip
_TOPIC_NOUNS = 8
_FILLER_OPENERS = ("the", "a new", "this week the", "on monday the", "after a long day the")
_FILLER_MIDDLE = ("with the", "near the", "and the", "over the", "against the")
_FILLER_ENDINGS = ("today", "again", "last night", "this year", "on friday", "after all")

# (question, answer, statement) facts of the multiple-choice subjects; statements go to pretraining.
_COLOR_FACTS = (("tomato", "red"), ("leaf", "green"), ("sky", "blue"), ("lemon", "yellow"),
                ("plum", "purple"), ("ice", "cyan"), ("carrot", "orange"), ("flamingo", "pink"))  # fmt: skip
_SHAPE_FACTS = (
    ("has three corners", "triangle"), ("has four equal sides", "square"), ("is perfectly round", "circle"),
    ("has a hole in the middle", "ring"), ("has five points", "star"), ("looks like a plus sign", "cross"),
    ("is a square turned on its corner", "diamond"), ("is long and flat", "bar"),
)  # fmt: skip
SUBJECTS = ("colors", "shapes", "numbers")
LETTERS = ("A", "B", "C", "D")

_CAPTION_TEMPLATES = (
    "a photo of a {color} {shape}.",
    "a {texture} {color} {shape}.",
    "a {color} {shape} on a {style} background.",
    "there is a {color} {shape} in the picture.",
)
CLASS_PROMPT = "a photo of a {}."
VQA_QUESTIONS = {
    "color": "what color is the object?",
    "shape": "what shape is the object?",
    "count": "how many objects are there?",
}
QUESTION_TYPES = tuple(VQA_QUESTIONS)
# Other wordings of each question (index 1..; 0 is the question above), built from words the generators already
# emit (so every tokenizer built on :func:`vocabulary` reads them): a domain's own phrasing, for a domain shift.
VQA_WORDINGS = {
    "color": ("what color are the objects in the picture?", "the object is what color?",
              "which color is the object in the photo?", "what is the color of the object?"),
    "shape": ("what shape are the objects in the picture?", "the object is what shape?",
              "which shape is the object in the photo?", "what is the shape of the object?"),
    "count": ("how many objects are in the picture?", "there are how many objects?",
              "how many objects are in this photo?", "how many objects are on the background?"),
}  # fmt: skip
# Question functions beyond reading the image, for a shift of functions, opt-in through ``question_types``:
# ``knowledge`` asks a fact (the colour of a thing, the shape with a property), ``arithmetic`` a sum of two numbers;
# both answer with words of VQA_ANSWERS.
EXTRA_QUESTION_TYPES = ("knowledge", "arithmetic")
ALL_QUESTION_TYPES = QUESTION_TYPES + EXTRA_QUESTION_TYPES
VQA_ANSWERS = COLORS + SHAPES + NUMBERS[:MAX_OBJECTS]
_FORMATS = (
    "Answer: {answer}",
    "Concepts: {concepts}",
    "Description: {description}",
    "Question: {question} Options: {options}",
    "Correct answer on {subject}: {letter}. {answer}",
    "what color is the {thing}?",
    "which shape {property}?",
    "what is {a} plus {b}?",
    "the {thing} is {color}.",
    "the {shape} {property}.",
    "{a} plus {b} is {total}.",
    "a {texture} {color} {shape}.",
)


def vocabulary() -> list[str]:
    """Every word and punctuation mark the generators can emit, sorted (no special tokens)."""
    texts: list[str] = [*_CAPTION_TEMPLATES, *VQA_QUESTIONS.values(), *_FORMATS, CLASS_PROMPT]
    texts += [*SHAPES, *COLORS, *TEXTURES, *STYLES, *NUMBERS, *SUBJECTS, *LETTERS]
    texts += [*_FILLER_OPENERS, *_FILLER_MIDDLE, *_FILLER_ENDINGS]
    texts += [word for words in TOPICS.values() for word in words] + list(TOPICS)
    texts += [thing for thing, _ in _COLOR_FACTS] + [prop for prop, _ in _SHAPE_FACTS]
    words = {token for text in texts for token in _split_words(re.sub(r"\{\w+\}", " ", text))}
    return sorted(words)


def _split_words(text: str) -> list[str]:
    """The same split as the tokenizers' ``Whitespace`` pre-tokenizer."""
    return re.findall(r"\w+|[^\w\s]+", text)


def class_prompts(classes: Sequence[str] = CLASSES, template: str = CLASS_PROMPT) -> list[str]:
    """Zero-shot prompts, one per class name: ``"a photo of a red circle."``."""
    return [template.format(name) for name in classes]


def draw_captions(objects: dict[str, np.ndarray], rng: np.random.Generator) -> list[str]:
    """A caption of each drawn object (:func:`rayfed.data.shape_scenes.draw_objects`), its template drawn."""
    templates = rng.integers(0, len(_CAPTION_TEMPLATES), len(objects["class"]))
    return [
        _CAPTION_TEMPLATES[t].format(color=COLORS[c], shape=SHAPES[s], texture=TEXTURES[x], style=STYLES[y])
        for t, c, s, x, y in zip(templates, objects["color"], objects["shape"], objects["texture"], objects["style"])
    ]


def topic_sentences(n: int, rng: np.random.Generator, topic_ids: np.ndarray) -> list[str]:
    """A news-like sentence of each topic in ``topic_ids`` (indices into :data:`TOPICS`), its words drawn."""
    sentences = []
    for topic in topic_ids:
        words = TOPICS[list(TOPICS)[topic]]
        nouns, verbs = words[:_TOPIC_NOUNS], words[_TOPIC_NOUNS:]
        parts = (_FILLER_OPENERS, nouns, verbs, _FILLER_MIDDLE, nouns, _FILLER_ENDINGS)
        sentences.append(" ".join(part[rng.integers(len(part))] for part in parts) + ".")
    return sentences


def subject_facts(subject: str) -> list[tuple[str, str, str]]:
    """(question, answer, statement) triples of one multiple-choice subject."""
    if subject == "colors":
        return [(f"what color is the {t}?", c, f"the {t} is {c}.") for t, c in _COLOR_FACTS]
    if subject == "shapes":
        return [(f"which shape {p}?", s, f"the {s} {p}.") for p, s in _SHAPE_FACTS]
    sums = [(NUMBERS[a], NUMBERS[b], NUMBERS[a + b + 1]) for a in range(4) for b in range(4)]
    return [(f"what is {a} plus {b}?", total, f"{a} plus {b} is {total}.") for a, b, total in sums]
