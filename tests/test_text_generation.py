"""Evaluation's text generation: each test batch decodes in one batched call with a KV cache, and its greedy
continuations are those of an uncached decoding of each prompt alone; the teacher-forced pass builds no cache.

In-process (no Ray): the tiny pretrained causal LMs, built directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayfed.config import ModelConfig
from rayfed.data import multimodal
from rayfed.data.sources import ArrayDataset
from rayfed.models import build_backbone, build_task_model
from rayfed.models.peft.named_adapters import decoder_layers
from rayfed.tasks import Task
from rayfed.tasks.kinds import TextGeneration
from rayfed.tasks.texts import text_end_id
from rayfed.training.scoring import Scorer

from conftest import method_class

# Prompts of different lengths, so that the batch's prompts are left-padded by different amounts.
TEXTS = ["Concepts: red circle", "Concepts: cyan circle solid striped", "Concepts: orange",
         "Concepts: solid bar orange checkered green ring", "Concepts: red solid diamond"]
QUESTIONS = ["what color is the object?", "how many?", "what shape is the object in the image?", "what color?",
             "how many objects are there?"]
LORA = {"rank": 2, "alpha": 4}


def _dataset(images: bool) -> ArrayDataset:
    if not images:
        return ArrayDataset(text=np.array(TEXTS), target=np.array(["Description: a solid red circle."] * len(TEXTS)))
    columns = multimodal.columns("vqa", len(QUESTIONS), seed=0, image_size=16)
    return ArrayDataset(images=columns["image"], text=np.array(QUESTIONS), target=np.array(columns["target"]))


def _lm_layers(model) -> torch.nn.ModuleList:
    """The language model's decoder layers (LLaVA's, not its vision tower's)."""
    scope = "model.language_model" if hasattr(model.encoder.model, "language_model") else None
    return decoder_layers(model.encoder, scope)[1]


def _model_and_batch(backbone_name: str, method: str | None = None, **params):
    """A text-generation model on ``backbone_name`` (LoRA, or ``method``'s own model) with every trainable value
    moved off its start (LoRA's B starts at 0), and a test batch of prompts of different lengths."""
    config = ModelConfig(backbone=backbone_name, lora=LORA)
    backbone = build_backbone(config, seed=0)
    tasks = [Task(0, "describe", kind=TextGeneration())]
    if method is None:
        model = build_task_model(backbone, config, tasks, seed=0)
    else:
        model = method_class(method)(method_class(method).Params(**params)).build_model(backbone, config, tasks, 0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    model.eval()
    dataset = _dataset("image" in backbone.modalities)
    batch = TextGeneration().encode(dataset, np.arange(len(dataset)), backbone)
    return model, batch


def _greedy_alone(model, batch: dict, row: int, max_new_tokens: int) -> list[int]:
    """Row ``row``'s greedy continuation decoded alone, without padding or a KV cache: the whole text so far through
    the model at every step, until end-of-text."""
    ids = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()][None]
    images = {"pixel_values": model.pixels(batch["pixel_values"][row:row + 1])} if "pixel_values" in batch else {}
    end = text_end_id(model.tokenizer, model.chat_template)
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model.encoder(input_ids=ids, use_cache=False, **images).logits[0, -1].argmax())
            tokens.append(token)
            if token == end:
                break
            ids = torch.cat([ids, ids.new_tensor([[token]])], dim=1)
    return tokens


@pytest.mark.parametrize(("backbone", "method", "params"), [
    ("tiny-pretrained:llama-small", None, {}),
    ("tiny-pretrained:qwen", None, {}),
    ("tiny-pretrained:llava", None, {}),
    ("tiny-pretrained:llama-small", "fedmosaic", {"relevance": "equal", "blocks": 1}),  # gated PQ-LoRA + LoRA
], ids=["llama", "qwen", "llava", "fedmosaic-pq-lora"])
def test_a_test_batch_decodes_together_with_a_kv_cache_as_each_prompt_alone_without_one(backbone, method, params):
    model, batch = _model_and_batch(backbone, method, **params)
    widths = batch["prompt_mask"].sum(dim=1)
    assert len(set(widths.tolist())) > 2  # prompts left-padded by different amounts
    seen: list[tuple[int, int]] = []  # (rows, tokens) of each forward through the language model
    hook = _lm_layers(model)[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(tuple((args[0] if args else kwargs["hidden_states"]).shape[:2])),
        with_kwargs=True)
    max_new_tokens = 6
    generated = model.generate_text(batch, max_new_tokens)
    hook.remove()
    rows, steps = generated.shape
    pad = model.tokenizer.pad_token_id
    assert steps > 2 and (generated == pad).any()  # several decode steps; some rows end before others
    # One call for the batch: the prompts once, then each step the rows' newest token alone (the KV cache).
    assert seen[0][0] == rows == len(widths) and seen[0][1] >= int(widths.max())
    assert seen[1:] == [(rows, 1)] * (steps - 1)
    for row in range(rows):
        alone = _greedy_alone(model, batch, row, max_new_tokens)
        assert generated[row, :len(alone)].tolist() == alone, row
        assert (generated[row, len(alone):] == pad).all(), row


def test_decoding_uses_a_kv_cache_even_where_a_checkpoints_generation_config_turns_it_off():
    model, batch = _model_and_batch("tiny-pretrained:llama-small")
    model.encoder.generation_config.use_cache = False  # as a hub folder's generation_config.json may say
    tokens: list[int] = []
    hook = _lm_layers(model)[0].register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True)
    generated = model.generate_text(batch, 4)
    hook.remove()
    assert generated.shape[1] > 1 and tokens[1:] == [1] * (generated.shape[1] - 1)


@pytest.mark.parametrize("backbone", ["tiny-pretrained:llama-small", "tiny-pretrained:llava"])
def test_the_teacher_forced_pass_builds_no_kv_cache_and_gives_the_same_logits(backbone):
    model, batch = _model_and_batch(backbone)
    caches = []
    hook = model.encoder.register_forward_hook(lambda module, args, output: caches.append(output.past_key_values))
    with torch.no_grad():
        logits = model(batch)
    hook.remove()
    assert caches == [None]
    inputs = model.inputs({k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values") if k in batch})
    with torch.no_grad():
        cached = model.encoder(**inputs, use_cache=True)
    assert cached.past_key_values is not None and torch.equal(cached.logits, logits)


def test_evaluation_generates_each_batch_of_eval_batch_size_rows_in_one_call():
    model, batch = _model_and_batch("tiny-pretrained:llama-small")
    task = Task(0, "describe", kind=TextGeneration())
    calls: list[int] = []
    generate = model.encoder.generate
    model.encoder.generate = lambda **kwargs: calls.append(len(kwargs["input_ids"])) or generate(**kwargs)
    with torch.no_grad():
        sums, count = Scorer(model, [task], torch.device("cpu"), 2, "off").score(task, batch)
        whole, _ = Scorer(model, [task], torch.device("cpu"), 256, "off").score(task, batch)
    assert count == 5 and calls == [2, 2, 1, 5]
    for name in ("token_f1", "exact_match", "meteor"):  # a row's generation does not depend on its batch
        assert sums[name] == whole[name], name
    assert sums["nll"] == pytest.approx(whole["nll"], rel=1e-6)
