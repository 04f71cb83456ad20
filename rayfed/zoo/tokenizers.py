"""A word-level tokenizer over the synthetic data's vocabulary, built in code (nothing to download).

It is a ``tokenizers`` WordLevel model wrapped in ``PreTrainedTokenizerFast``; saved with
``save_pretrained`` next to a model, ``AutoTokenizer.from_pretrained(folder)`` loads it back as a hub
tokenizer would be loaded (:func:`load_tokenizer` covers the one model type where it cannot).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from rayfed.data.multimodal import vocabulary
from rayfed.lazy import DeferredModule

transformers = DeferredModule("transformers")

PAD, UNK, BOS, EOS, MASK, IMAGE = "<pad>", "<unk>", "<bos>", "<eos>", "<mask>", "<image>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS, MASK, IMAGE)  # ids 0..5, in this order


def word_tokenizer(*, append_eos: bool, model_max_length: int = 64) -> transformers.PreTrainedTokenizerFast:
    """Special tokens + :func:`rayfed.data.multimodal.vocabulary`, split on whitespace and punctuation.

    Every encoded text starts with ``<bos>``; encoders (CLIP, ViLT, FLAVA) also end it with ``<eos>``
    (``append_eos=True``: CLIP pools its text at the first ``<eos>``), decoders (Llama, LLaVA) do not, so
    that a prompt can be continued.
    """
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *vocabulary()])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(list(SPECIAL_TOKENS))  # matched before splitting, so "<image>" stays one token
    template = f"{BOS} $A {EOS}" if append_eos else f"{BOS} $A"
    backend.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(BOS, vocab[BOS]), (EOS, vocab[EOS])]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD, unk_token=UNK, bos_token=BOS, eos_token=EOS, mask_token=MASK,
        model_max_length=model_max_length,
    )  # fmt: skip


def load_tokenizer(name_or_path: str) -> transformers.PreTrainedTokenizerBase:
    """``AutoTokenizer.from_pretrained(name_or_path)``; a folder holding a word-level tokenizer (written by
    :func:`word_tokenizer`) is loaded from its ``tokenizer.json`` as is.

    For some model types (``qwen2`` in transformers 5) AutoTokenizer imposes the type's own tokenizer
    class, which rebuilds the pipeline as byte-level BPE and would garble a word-level vocabulary.
    """
    tokenizer_file = Path(name_or_path) / "tokenizer.json"
    if tokenizer_file.is_file() and json.loads(tokenizer_file.read_text())["model"]["type"] == "WordLevel":
        return transformers.PreTrainedTokenizerFast.from_pretrained(name_or_path)
    return transformers.AutoTokenizer.from_pretrained(name_or_path)
