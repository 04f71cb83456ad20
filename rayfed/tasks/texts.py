"""The texts a task kind encodes: its prompts (a multi-modal LLM's image tokens where the text marks its images, else
before it; the tokenizer's chat template where the backbone uses one), a target's tokens and how wide a set of texts
is padded.

Width: with ``data.max_text_length`` (the backbone's ``max_text_length``) every text is padded to it; without, to the
longest text of the set rounded up to :data:`TEXT_BUCKET` tokens and at most the backbone's own limit
(``text_limit``: its positions, image tokens included), so a model of 128k positions pads short prompts to 64, not
to its limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rayfed.errors import ConfigError

if TYPE_CHECKING:
    from rayfed.data.sources import ArrayDataset
    from rayfed.models.backbone import Backbone

TEXT_BUCKET = 64
# A chat template that dates its prompts (Llama 3's writes today's date into its system turn) gets its own fallback
# date instead, so a rerun renders the same prompts.
_TEMPLATE_DATE = {"date_string": "26 Jul 2024"}
_PROBE_QUESTION, _PROBE_ANSWER = "rayfed-question", "rayfed-answer"


def text_width(backbone: Backbone, longest: int) -> int:
    """How many tokens a set of texts whose longest has ``longest`` tokens is padded to (see the module)."""
    if backbone.max_text_length is not None:
        return backbone.max_text_length
    return min(backbone.text_limit, -(-longest // TEXT_BUCKET) * TEXT_BUCKET)


def tokenize(texts: Sequence[str], backbone: Backbone) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``texts`` (prompts of :func:`prompts`), right-padded to :func:`text_width`
    and cut to it."""
    tokenizer, texts = backbone.tokenizer, list(texts)
    special = not backbone.chat_template  # a chat template writes the special tokens itself
    if backbone.max_text_length is None:
        lengths = tokenizer(texts, truncation=True, max_length=backbone.text_limit, add_special_tokens=special)
        width = text_width(backbone, max(map(len, lengths["input_ids"])))
    else:
        width = backbone.max_text_length
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=width, return_tensors="pt",
                        **({} if special else {"add_special_tokens": False}))
    return encoded["input_ids"], encoded["attention_mask"]


def prompt_tokens(prompts: Sequence[str], backbone: Backbone) -> list[list[int]]:
    """Each prompt's token ids, unpadded (special tokens added unless the chat template wrote them)."""
    return [backbone.tokenizer(p, add_special_tokens=not backbone.chat_template)["input_ids"] for p in prompts]


def target_tokens(targets: Sequence[str], backbone: Backbone) -> list[list[int]]:
    """Each target's token ids as a causal LM learns them after its prompt, ending with the token that ends a text
    (:func:`text_end_id`): after a space, or after a chat template's assistant header as it stands."""
    tokenizer, end = backbone.tokenizer, text_end_id(backbone.tokenizer, backbone.chat_template)
    lead = "" if backbone.chat_template else " "
    return [tokenizer(lead + t, add_special_tokens=False)["input_ids"] + [end] for t in targets]


def prompts(dataset: ArrayDataset, indices: np.ndarray, backbone: Backbone) -> list[str]:
    """The input texts of ``indices``: a multi-modal LLM's image tokens for each image of a sample (at the text's
    image placeholders, else before the text), each wrapped in the tokenizer's chat template where the backbone uses
    it."""
    texts = [str(t) for t in dataset.text[indices]] if dataset.text is not None else [""] * len(indices)
    if backbone.image_prompt and dataset.images is not None:
        counts = [1] * len(texts) if dataset.image_counts is None else dataset.image_counts[indices].tolist()
        texts = [with_images(text, count, backbone) for text, count in zip(texts, counts)]
    if backbone.chat_template:
        texts = [chat_prompt(backbone.tokenizer, text) for text in texts]
    return texts


def with_images(text: str, count: int, backbone: Backbone) -> str:
    """``text`` with the image tokens of ``count`` images: one run at each of its placeholders (it must mark all of
    them, or none), else all runs before it (after a space; on a new line, LLaVA's layout, in a chat template)."""
    placeholder, run = backbone.image_placeholder, backbone.image_prompt
    marks = text.count(placeholder) if placeholder else 0
    if marks == 0:
        return run * count + ("\n" if backbone.chat_template else " ") + text
    if marks != count:
        raise ConfigError(
            f"the text {text[:80]!r} marks {marks} images with {placeholder!r}, but its sample has {count}; mark every "
            f"image of a sample once, or none (its images then go before the text)."
        )
    return text.replace(placeholder, run)


def too_long(backbone: Backbone, prompt: int, target: int) -> str:
    """The sentence refusing a prompt of ``prompt`` tokens and a target of ``target`` that do not fit the width."""
    if backbone.max_text_length is not None:
        return (f"data.max_text_length = {backbone.max_text_length} is too short for a prompt of {prompt} tokens and a "
                f"target of {target}; raise data.max_text_length.")
    return (f"a prompt of {prompt} tokens and a target of {target} exceed the text limit of {backbone.config_field} = "
            f"{backbone.name!r}, {backbone.text_limit} tokens (its image tokens included); shorten the texts.")


# Chat templates ---------------------------------------------------------------------------------------------------
def chat_prompt(tokenizer: Any, question: str) -> str:
    """``question`` as the user's turn of the tokenizer's chat template, up to the assistant's header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True, **_TEMPLATE_DATE)


def text_end_id(tokenizer: Any, chat_template: bool) -> int:
    """The token that ends a target text: in a chat template the one that closes the assistant's turn (Llama 3's
    ``<|eot_id|>``, Qwen's ``<|im_end|>``), else the tokenizer's end-of-sequence (or separator) token."""
    if not chat_template:
        return end_of_text_id(tokenizer)
    prompt = chat_prompt(tokenizer, _PROBE_QUESTION)
    conversation = tokenizer.apply_chat_template(
        [{"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _PROBE_ANSWER}],
        tokenize=False, **_TEMPLATE_DATE)
    if _PROBE_QUESTION not in prompt or not conversation.startswith(prompt) or _PROBE_ANSWER not in conversation:
        raise ConfigError(
            f"the chat template of the backbone's tokenizer ({type(tokenizer).__name__}) does not write a plain-text "
            "user and assistant turn as given; set model.chat_template: false to use the raw prompts."
        )
    closing = conversation[len(prompt):].split(_PROBE_ANSWER, 1)[1].strip()
    tokens = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    return tokens[0] if tokens else end_of_text_id(tokenizer)


def end_of_text_id(tokenizer: Any) -> int:
    """The token that ends a target text: the tokenizer's end-of-sequence token, or, for a BERT-style tokenizer
    that has none (ViLT's, FLAVA's), its separator token."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if end is None:
        raise ConfigError(f"the backbone's tokenizer ({type(tokenizer).__name__}) has neither an end-of-sequence nor "
                          "a separator token, so a generated text cannot end; give it an eos_token.")
    return end
