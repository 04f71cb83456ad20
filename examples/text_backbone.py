"""Bring your own text model: a small BERT built from a config (random weights, nothing downloaded) and its own
word tokenizer, registered as a backbone and fine-tuned with LoRA on a text classification source.

    python examples/text_backbone.py [key.sub=value ...]

The backbone declares what it reads (``modalities={"text"}``), how texts become tokens (``tokenizer``, called on a
list of strings with ``padding="max_length", truncation=True, max_length=..., return_tensors="pt"``, to at most
``max_text_length`` tokens) and how its encoder gives one feature vector per sample (``features(encoder, batch)`` ->
(N, ``feature_dim``)). The batch it is handed also holds the task's ``labels``; ``features`` reads only the inputs.
The source returns its labels in a column ``topic``, which ``data.label_column`` names.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import rayfed

TOPICS = {
    "sports": ["goal", "match", "team", "score", "coach", "league", "player", "stadium"],
    "food": ["bread", "soup", "cheese", "spice", "oven", "recipe", "flavor", "dinner"],
    "weather": ["rain", "storm", "cloud", "sunny", "wind", "snow", "forecast", "humid"],
    "music": ["song", "guitar", "drum", "melody", "concert", "album", "singer", "chorus"],
}
FILLER = ["the", "a", "today", "we", "saw", "about", "very", "some", "new", "old", "with", "and", "this", "that",
          "big", "small", "after", "before", "really", "again"]
VOCABULARY = sorted({*FILLER, *(word for words in TOPICS.values() for word in words)})


@rayfed.register_source("topics")
def topics(request: rayfed.SourceRequest) -> dict:
    """Sentences of ``words`` words (data.options; default 6), half of them from one topic, the rest filler."""
    rng = np.random.default_rng(request.seed)
    count, length = int(request.options.get("num_samples", 800)), int(request.options.get("words", 6))
    names = sorted(TOPICS)
    topic_of = rng.integers(0, len(names), size=count)
    texts = []
    for topic in topic_of:
        words = [*rng.choice(TOPICS[names[topic]], size=length // 2), *rng.choice(FILLER, size=length - length // 2)]
        texts.append(" ".join(rng.permutation(words)))
    return {"text": np.asarray(texts, dtype=object), "topic": np.asarray([names[t] for t in topic_of])}


def word_tokenizer(max_length: int):
    """A word-level tokenizer over VOCABULARY: ``[CLS] words... [SEP]``, padded with ``[PAD]`` (id 0)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {token: index for index, token in enumerate([*special, *VOCABULARY])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
        model_max_length=max_length)


def mean_pooled(encoder, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, hidden) features: the last hidden state averaged over each sequence's real tokens."""
    mask = batch["attention_mask"]
    hidden = encoder(input_ids=batch["input_ids"], attention_mask=mask).last_hidden_state
    weights = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)


@rayfed.register_backbone("tiny-bert")
def tiny_bert(request: rayfed.BackboneRequest) -> rayfed.Backbone:
    """A 2-block BERT of width 32, randomly initialised (seeded by the run), over its own word tokenizer."""
    import transformers

    max_length = 16
    tokenizer = word_tokenizer(max_length)
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=max_length,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     pad_token_id=tokenizer.pad_token_id)
    encoder = transformers.BertModel(config, add_pooling_layer=False)
    return rayfed.Backbone(encoder=encoder, feature_dim=config.hidden_size, features=mean_pooled,
                           modalities=frozenset({"text"}), tokenizer=tokenizer, max_text_length=max_length,
                           lora_targets=("query", "value"))


CONFIG = {
    "name": "text_backbone",
    "data": {"source": "topics", "label_column": "topic", "num_clients": 8,
             "partition": {"name": "dirichlet", "alpha": 1.0, "min_samples": 20}},
    "model": {"backbone": "tiny-bert", "lora": {"rank": 4, "alpha": 8}},
    "federation": {"rounds": 10, "clients_per_round": 4, "eval_every": 5},
    "train": {"local_steps": 5, "batch_size": 16, "lr": 0.05, "optimizer": "adam"},
    "methods": ["local", "fedavg"],
    "placement": {"clients_per_actor": 4},
}

if __name__ == "__main__":
    simulation = rayfed.Simulation(CONFIG, overrides=sys.argv[1:])
    summary = simulation.run()
    for label, result in summary["methods"].items():
        print(f"{label}: local_acc = {result['mean']['local_acc']:.4f}")
    print(f"results: {simulation.run_dir}")
