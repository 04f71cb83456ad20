"""Task groups with conflicting answer maps (FedMosaic's offline benchmark,
docs/fedmosaic.md#the-offline-benchmark).

``task-groups:vqa`` is the synthetic VQA task (:mod:`rayfed.data.multimodal`) whose answers pass through a
permutation of their own group: ``options.group`` g of ``options.groups`` G. Within each answer category (colours,
shapes, counts) every group's map shifts the answers by a different non-zero step along one seeded order
(``options.map_seed``, fixed by the benchmark rather than the run's seed), so no two groups give an image the same
answer: clients of one group share a rule, and averaging across groups interferes. The other options are
``multimodal:vqa``'s (``num_samples``, ``classes``, ``styles``, ``question_types``, ``image_size``);
``answer_only`` (default true) makes the target the answer word alone (``"blue"``, one token: one label token, as the
offline benchmark asks; docs/fedmosaic.md#the-offline-benchmark), else ``"Answer: blue"``.
"""

from __future__ import annotations

import numpy as np

from rayfed.data.sources import ArrayDataset, DataError, SourceRequest
from rayfed.registry import register_source, resolve

def answer_maps(groups: int, map_seed: int = 0) -> list[dict[str, str]]:
    """One answer permutation per group: within each category, group g maps the answer at position p of a
    seeded order to the one at position p + g + 1 (mod the category's size)."""
    from rayfed.data import multimodal

    categories = (multimodal.COLORS, multimodal.SHAPES, multimodal.NUMBERS[:multimodal.MAX_OBJECTS])
    if not 1 <= groups < min(len(c) for c in categories):
        raise DataError(f"data.options.groups = {groups} is invalid: it must be in "
                        f"1..{min(len(c) for c in categories) - 1} "
                        "so that every group's answer map differs from the others' on every answer.")
    rng = np.random.default_rng(np.random.SeedSequence([map_seed, 1005]))
    maps: list[dict[str, str]] = [{} for _ in range(groups)]
    for values in categories:
        order = [values[i] for i in rng.permutation(len(values))]
        for group in range(groups):
            for position, answer in enumerate(order):
                maps[group][answer] = order[(position + group + 1) % len(order)]
    return maps


@register_source("task-groups:")
def task_group_source(request: SourceRequest) -> ArrayDataset:
    """``task-groups:vqa``: VQA answered through the answer map of ``options.group`` (see the module docstring)."""
    from rayfed.data import multimodal

    if request.argument != "vqa":
        raise DataError(f"data.source = {request.name!r} names no grouped task; allowed: task-groups:vqa.")
    options = request.options
    group, groups = options.pop("group", 0), options.pop("groups", 3)
    map_seed, answer_only = options.pop("map_seed", 0), options.pop("answer_only", True)
    for key, value in (("group", group), ("groups", groups), ("map_seed", map_seed)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise DataError(f"data.options.{key} = {value!r} is invalid: it must be an integer.")
    if not 0 <= group < groups:
        raise DataError(
            f"data.options.group = {group} is invalid: it must be in 0..{groups - 1} (data.options.groups)."
        )
    inner = resolve("source", "multimodal:vqa")
    config = request.config.model_copy(update={"source": "multimodal:vqa", "options": options})
    dataset: ArrayDataset = inner.obj(SourceRequest(config, request.seed, inner.argument))
    answer_map = answer_maps(groups, map_seed)[group]
    answers = [answer_map[multimodal.VQA_ANSWERS[label]] for label in dataset.labels]
    labels = np.array([multimodal.VQA_ANSWERS.index(a) for a in answers], dtype=np.int64)
    target = np.array(answers if answer_only else [f"Answer: {a}" for a in answers], dtype=object)
    return ArrayDataset(dataset.images, labels, dataset.class_names, dataset.groups, text=dataset.text, target=target,
                        domains=dataset.domains)

