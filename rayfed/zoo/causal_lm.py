"""Decoder-only language models in HF transformers: Llama-style (``LlamaForCausalLM``) at two sizes,
shallow-narrow and deep-wide (clients of different sizes in one federation), and a Qwen2-style model
(``Qwen2ForCausalLM``, qkv bias) of another width. They stand in for Llama-3 / Qwen2.5 LLMs and are
pretrained by next-token prediction on the ``statements`` corpus (captions, facts, news sentences).

Depths are multiples of 8 (8, 16, 8), so the seed papers' block rules (halves, quarters, eighths of the
layers) split them evenly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rayfed.lazy import DeferredModule
from rayfed.zoo import training
from rayfed.zoo.registry import BuildReport, Metrics, ZooModel
from rayfed.zoo.tokenizers import EOS, load_tokenizer, word_tokenizer

transformers = DeferredModule("transformers")

_TRAIN = {"steps": 200, "batch_size": 32, "lr": 3e-3, "weight_decay": 0.01}
_DATA = {"train_samples": 4096, "eval_samples": 512, "max_length": 20}


def _recipe(architecture: str, hidden_size: int, layers: int) -> dict[str, Any]:
    model = {
        "hidden_size": hidden_size, "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 3 * hidden_size, "max_position_embeddings": 64,
    }  # fmt: skip
    return {"version": 2, "seed": 0, "architecture": architecture, "model": model, "train": _TRAIN, "data": _DATA}


# Small enough that the built folders (float16) ship with rayfed: llama-small and llama-large differ in
# both depth and width, qwen has a third width.
RECIPES: dict[str, dict[str, Any]] = {
    "llama-small": _recipe("llama", hidden_size=48, layers=8),
    "llama-large": _recipe("llama", hidden_size=64, layers=16),
    "qwen": _recipe("qwen2", hidden_size=56, layers=8),
}
_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def tiny_config(
    architecture: str, model: Mapping[str, Any], tokenizer: transformers.PreTrainedTokenizerBase
) -> transformers.PretrainedConfig:
    """A ``LlamaConfig`` or ``Qwen2Config`` of the sizes in ``model`` over the tokenizer's vocabulary."""
    return getattr(transformers, _CONFIGS[architecture])(
        **model, vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip


def load(name_or_path: str) -> ZooModel:
    """``AutoModelForCausalLM`` (float32) and its tokenizer from a hub name or a local folder."""
    return ZooModel(
        transformers.AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32),
        load_tokenizer(name_or_path),
    )


def sequences(
    tokenizer: transformers.PreTrainedTokenizerBase, texts: list[str], max_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``<bos> text <eos>`` token ids, attention mask and next-token labels (-100 on padding)."""
    input_ids, attention_mask = training.encode(tokenizer, [f"{text} {EOS}" for text in texts], max_length)
    return input_ids, attention_mask, torch.where(attention_mask.bool(), input_ids, -100)


def build(out_dir: Path, recipe: Mapping[str, Any], dependencies: Mapping[str, Path]) -> BuildReport:
    data = recipe["data"]
    tokenizer = word_tokenizer(append_eos=False, model_max_length=recipe["model"]["max_position_embeddings"])
    config = tiny_config(recipe["architecture"], recipe["model"], tokenizer)
    model = transformers.AutoModelForCausalLM.from_config(config)
    before = _metrics(model, tokenizer, recipe)

    corpus = training.text_corpus(data["train_samples"], seed=recipe["seed"])
    input_ids, attention_mask, labels = sequences(tokenizer, corpus["text"], data["max_length"])

    def next_token_loss(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=input_ids[batch], attention_mask=attention_mask[batch], labels=labels[batch]).loss

    training.train(model, next_token_loss, num_samples=len(input_ids), seed=recipe["seed"], **recipe["train"])
    training.save_float16(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    return BuildReport(before, evaluate(out_dir, recipe), training.parameter_count(model))


def evaluate(path: Path, recipe: Mapping[str, Any]) -> Metrics:
    loaded = load(str(path))
    return _metrics(loaded.model, loaded.tokenizer, recipe)


@torch.no_grad()
def _metrics(model: transformers.PreTrainedModel, tokenizer: Any, recipe: Mapping[str, Any]) -> Metrics:
    """``perplexity`` and ``next_token_acc`` on held-out sentences of the pretraining corpus."""
    model.eval()
    n, max_length = recipe["data"]["eval_samples"], recipe["data"]["max_length"]
    corpus = training.text_corpus(n, seed=recipe["seed"] + 10_000)
    input_ids, attention_mask, labels = sequences(tokenizer, corpus["text"], max_length)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets = labels[:, 1:]
    predicted = targets != -100
    nll = torch.nn.functional.cross_entropy(logits[predicted], targets[predicted])
    return {
        "perplexity": math.exp(nll.item()),
        "next_token_acc": float((logits[predicted].argmax(-1) == targets[predicted]).float().mean()),
    }
