"""Task kinds: what a task's examples become, its loss, and its metrics.

A task kind is a plug-in (:mod:`rayfed.registry`, ``data.kind``): a :class:`TaskKind` subclass that
turns a dataset's columns into named tensors for a backbone (:meth:`TaskKind.encode`), adds a head to
the default client model (:meth:`TaskKind.build_head`), computes the model's outputs and the loss of a
batch, and scores a model on test data. This module is where the kinds are found: the base class and the
built-ins' shared inputs are :mod:`rayfed.tasks.kind_base`'s, each built-in kind family has a module of its own
(:mod:`rayfed.tasks.classification`, :mod:`rayfed.tasks.text_generation`, :mod:`rayfed.tasks.reconstruction`),
and every name is importable from here. The built-ins:

- ``classification``: images, text or both -> one of the task's classes (VQA as answer classification);
  ``acc``, ``loss``;
- ``multiple_choice``: a question and its options -> the right option, each option scored by a head on
  the backbone's features of (question, option) or, on a causal LM, by the option's log-likelihood;
  ``acc``, ``loss``;
- ``text_generation``: a prompt (and image) -> the target text, a causal LM's next-token loss on the
  target tokens; ``token_f1``, ``exact_match`` and ``meteor`` of greedy generations
  (:mod:`rayfed.tasks.text_metrics`), ``perplexity`` of the target;
- ``reconstruction``: an image -> the same image from the backbone's features through a decoder head;
  ``mse``.

Metrics are reported as ``local_<metric>`` on a client's own test data and ``<set>_<metric>`` on shared
evaluation sets; :attr:`TaskKind.lower_is_better` tells reports which way is better.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

# The kinds by family, each registered on import (this module is the registry's for data.kind), and what a kind or a
# method imports from here.
from rayfed.tasks.kind_base import IGNORE, TaskKind, image_tensor, valid_images  # noqa: F401
from rayfed.tasks.classification import Classification, MultipleChoice  # noqa: F401
from rayfed.tasks.reconstruction import Reconstruction  # noqa: F401
from rayfed.tasks.text_generation import (  # noqa: F401
    GENERATION_LENGTH, TextGeneration, causal_from_target_logits, generate,
)
from rayfed.tasks.texts import end_of_text_id  # noqa: F401 (where methods import it from)

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset


def infer_kind(dataset: ArrayDataset) -> str:
    """The kind a dataset's columns call for: options -> multiple_choice, labels -> classification, target
    text -> text_generation, images alone -> reconstruction."""
    if dataset.choices is not None:
        return "multiple_choice"
    if dataset.labels is not None:
        return "classification"
    if dataset.target is not None:
        return "text_generation"
    return "reconstruction"
