"""Task kinds and foundation-model backbones: what a client's examples become, losses, metrics, refusals.

In-process (no Ray): ClientActors are plain Python objects here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayfed import zoo
from rayfed.tasks import text_metrics
from rayfed.actors.client import ClientActor
from rayfed.config import ModelConfig, load_config
from rayfed.data.clients import build_federation
from rayfed.data.sources import ArrayDataset
from rayfed.errors import ConfigError
from rayfed.tasks.kinds import IGNORE, MultipleChoice, TextGeneration, infer_kind
from rayfed.models import IMAGE, TEXT, build_backbone, build_task_model, causal_lm_features
from rayfed.simulation import Simulation
from rayfed.tasks import Task

TRAIN = {"local_steps": 3, "batch_size": 8, "lr": 0.003, "optimizer": "adam"}


def _run(source: str, backbone: str, kind: str | None = None, clients: int = 2, **options) -> dict:
    data = {"source": source, "options": {"num_samples": 120, **options}, "num_clients": clients,
            "partition": {"name": "iid"}, **({"kind": kind} if kind else {})}
    return {"name": "kinds", "seed": 1, "data": data, "model": {"backbone": backbone, "lora": {"rank": 2}},
            "federation": {"rounds": 2, "clients_per_round": clients}, "train": dict(TRAIN),
            "methods": ["fedavg"], "placement": {"clients_per_actor": clients, "cpus_per_actor": 0.5}}


def _actor(run: dict, clients: list[int] | None = None) -> ClientActor:
    config = load_config(run)
    return ClientActor(config, clients if clients is not None else list(range(config.data.num_clients)))


# Backbones by family, through the real from_pretrained path ------------------------------------------
@pytest.mark.parametrize(("family", "modalities", "generates", "targets"), [
    ("vilt", {IMAGE, TEXT}, False, ("query", "value")),
    ("flava", {IMAGE, TEXT}, False, ("query", "value")),
    ("llama-small", {TEXT}, True, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("qwen", {TEXT}, True, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("llava", {IMAGE, TEXT}, True, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
])
def test_hf_folders_of_every_family_load_as_backbones(family, modalities, generates, targets):
    folder = zoo.pretrained(family)  # a save_pretrained folder, as a hub download would give
    backbone = build_backbone(ModelConfig(backbone=f"hf:{folder}"), seed=0)
    assert backbone.modalities == modalities and backbone.generates_text == generates
    assert backbone.lora_targets == targets and backbone.tokenizer is not None
    assert not any(p.requires_grad for p in backbone.encoder.parameters())
    task = Task(0, "t", ("a", "b", "c"))
    model = build_task_model(backbone, ModelConfig(backbone=f"hf:{folder}", lora={"rank": 2}), [task], 0)
    lora = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    assert lora and all(any(f".{t}." in n for t in targets) for n in lora)
    if family == "llava":  # LoRA on the language model only, not the vision tower
        assert all("language_model" in n for n in lora)


def test_an_unknown_model_type_names_what_is_allowed(tmp_path):
    import transformers

    transformers.ResNetModel(transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8], depths=[1])).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"is a 'resnet' model; allowed are ViT, CLIP .*ViLT, FLAVA, LLaVA"):
        build_backbone(ModelConfig(backbone=f"hf:{tmp_path}"), seed=0)


# Encoding: named columns per kind ------------------------------------------------------------------
def test_vqa_on_vilt_is_answer_classification_over_image_and_question():
    actor = _actor(_run("multimodal:vqa", "tiny-pretrained:vilt"), [0])
    part = actor.data[0].parts[0]
    assert set(part.train) == {"pixel_values", "input_ids", "attention_mask", "labels"}
    assert part.train["pixel_values"].shape[1:] == (3, 32, 32)
    task = actor.tasks[0]
    assert task.kind.name == "classification" and task.num_classes == 20  # colours, shapes, counts
    shared = actor.start_method(0)
    assert "head.weight" in shared and shared["head.weight"].shape == (20, actor.backbone.feature_dim)


def test_text_generation_labels_only_the_target_tokens():
    actor = _actor(_run("multimodal:description", "tiny-pretrained:llama-small"), [0])
    columns = actor.data[0].parts[0].train
    tokenizer = actor.backbone.tokenizer
    for row in range(3):
        ids, labels, mask = columns["input_ids"][row], columns["labels"][row], columns["attention_mask"][row]
        answer = labels != IGNORE
        decoded = tokenizer.decode(ids[answer], skip_special_tokens=True)
        target = tokenizer.decode(columns["target_ids"][row], skip_special_tokens=True)
        assert decoded == target and target.startswith("Description :")  # the word tokenizer spaces marks
        assert torch.equal(labels[answer], ids[answer]) and mask[answer].all()
        # the prompt is left-padded for generation and holds the concepts, not the answer
        prompt = columns["prompt_ids"][row][columns["prompt_mask"][row].bool()]
        assert tokenizer.decode(prompt, skip_special_tokens=True).startswith("Concepts :")
        assert torch.equal(prompt, ids[: len(prompt)])


def test_text_generation_loss_ignores_the_prompt():
    kind = TextGeneration()
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE], [IGNORE, 1, 2, IGNORE, IGNORE]])
    expected = torch.nn.functional.cross_entropy(
        torch.stack([logits[0, 1], logits[0, 2], logits[1, 0], logits[1, 1]]), torch.tensor([3, 4, 1, 2]))
    assert kind.loss(logits, {"labels": labels}) == pytest.approx(expected.item())


def test_a_causal_lm_scores_an_option_by_its_log_likelihood_after_the_question():
    actor = _actor(_run("multimodal:multiple-choice", "tiny-pretrained:llama-small"), [0])
    actor.start_method(0)
    batch = {k: v[:2] for k, v in actor.data[0].parts[0].train.items()}
    assert batch["input_ids"].shape[:2] == (2, 4) and "option_mask" in batch
    with torch.no_grad():
        scores = MultipleChoice().forward(actor.model, batch)
        ids, mask = batch["input_ids"][1, 2], batch["attention_mask"][1, 2]
        logits = actor.model.lm_logits({"input_ids": ids[None], "attention_mask": mask[None]})[0].log_softmax(-1)
    option = batch["option_mask"][1, 2]
    expected = sum(logits[t - 1, ids[t]] for t in range(1, len(ids)) if option[t])
    assert scores.shape == (2, 4) and scores[1, 2].item() == pytest.approx(float(expected), rel=1e-5)
    last = int(mask.sum())  # the option's tokens end the sequence
    assert option.any() and option[:last].tolist() == sorted(option[:last].tolist()) and not option[last:].any()


def test_reconstruction_decodes_images_of_the_datas_shape():
    actor = _actor(_run("multimodal:shapes", "tiny-pretrained:vit", kind="reconstruction"), [0])
    task = actor.tasks[0]
    assert task.kind.name == "reconstruction" and task.image_shape == (3, 32, 32)
    actor.start_method(0)
    batch = {k: v[:3] for k, v in actor.data[0].parts[0].train.items()}
    assert actor.model(batch).shape == (3, 3, 32, 32)


def test_the_kind_follows_the_data_unless_set():
    images = np.zeros((2, 4, 4, 1), np.float32)
    assert infer_kind(ArrayDataset(images, np.zeros(2, np.int64), ("a",))) == "classification"
    assert infer_kind(ArrayDataset(text=np.array(["q", "r"]), target=np.array(["a", "b"]))) == "text_generation"
    assert infer_kind(ArrayDataset(images)) == "reconstruction"
    choices = np.array([["x", "y"], ["x", "y"]], dtype=object)
    assert infer_kind(ArrayDataset(labels=np.zeros(2, np.int64), text=np.array(["q", "r"]), choices=choices)) == (
        "multiple_choice")


# Metrics ---------------------------------------------------------------------------------------------
def test_text_metrics_on_hand_computed_cases():
    assert text_metrics.token_f1("a red circle", "a red square") == pytest.approx(2 / 3)
    assert text_metrics.token_f1("", "") == 1.0 and text_metrics.token_f1("x", "") == 0.0
    assert text_metrics.exact_match("Answer: Red", "answer : red") == 1.0
    # 3 of 4 words match in one chunk ... P = 3/3, R = 3/4
    p, r = 1.0, 0.75
    fmean = 10 * p * r / (r + 9 * p)
    assert text_metrics.meteor("the red ball", "the red ball rolls") == pytest.approx(fmean * (1 - 0.5 * (1 / 3) ** 3))
    # the same words out of order make three chunks
    assert text_metrics.meteor("ball red the", "the red ball") == pytest.approx(1.0 * (1 - 0.5 * (3 / 3) ** 3))
    assert text_metrics.meteor("blue", "red") == 0.0


def test_text_generation_metrics_rise_and_perplexity_falls_when_the_model_learns():
    actor = _actor(_run("multimodal:description", "tiny-pretrained:llama-small", clients=1), [0])
    shared = actor.start_method(0)
    before = actor.evaluate(0, {0: shared})[0]
    assert set(before) == {"local_token_f1", "local_exact_match", "local_meteor", "local_perplexity"}
    trained = actor._context(0, 0).train(shared, steps=30).params
    after = actor.evaluate(0, {0: trained})[0]
    assert after["local_perplexity"] < before["local_perplexity"]
    assert after["local_token_f1"] > before["local_token_f1"]


# Refusals: one sentence naming the fields ---------------------------------------------------------
@pytest.mark.parametrize(("source", "backbone", "kind", "message"), [
    ("multimodal:topics", "tiny:vit", None,
     r"model\.backbone = 'tiny:vit' reads images only and cannot run data\.kind = 'classification' on the text"),
    ("multimodal:description", "tiny-pretrained:vilt", None,
     r"model\.backbone = 'tiny-pretrained:vilt' does not generate text, so it cannot run data\.kind = "
     r"'text_generation'"),
    ("multimodal:vqa", "tiny-pretrained:llama-small", "text_generation",
     r"reads text only and cannot run data\.kind = 'text_generation' on the images of data\.source"),
    ("multimodal:vqa", "tiny-pretrained:llama-small", "classification",
     r"reads text only and cannot run data\.kind = 'classification' on the images of data\.source"),
    ("multimodal:topics", "tiny-pretrained:llama-small", "reconstruction",
     r"data\.kind = 'reconstruction' needs images, which data\.source does not have"),
    ("multimodal:description", "tiny-pretrained:llama-small", "classification",
     r"data\.kind = 'classification' needs class labels, which data\.source does not have"),
    ("multimodal:topics", "tiny-pretrained:llama-small", "multiple_choice",
     r"data\.kind = 'multiple_choice' needs the options of each question \(data\.choices_column\)"),
    ("multimodal:topics", "tiny-pretrained:llama-small", "classify",
     r"data\.kind = 'classify' is not known \(did you mean 'classification'\?\)"),
])
def test_a_task_a_backbone_cannot_run_is_refused_in_one_sentence(tmp_path, source, backbone, kind, message):
    with pytest.raises(ConfigError, match=message) as info:
        Simulation(_run(source, backbone, kind), out_dir=tmp_path, progress=False).run()  # before Ray starts
    assert "\n" not in str(info.value) and str(info.value).endswith(".")
    assert not (tmp_path / "config.yaml").exists()


def test_a_prompt_longer_than_the_text_limit_names_the_field():
    run = _run("multimodal:description", "tiny-pretrained:llama-small")
    run["data"]["max_text_length"] = 8
    with pytest.raises(ConfigError, match=r"data\.max_text_length = 8 is too short for a prompt of \d+ tokens"):
        _actor(run, [0])


def test_adapters_after_a_bert_style_output_only_on_bert_style_layers():
    vilt = ModelConfig(backbone="tiny-pretrained:vilt", module="adapter", adapter={"dim": 4, "site": "output"})
    model = build_task_model(build_backbone(vilt, 0), vilt, [Task(0, "t", ("a", "b"))], 0)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad and "adapters" in n]
    layers = model.encoder.config.num_hidden_layers
    assert len({n.split(".output.")[0] for n in adapters}) == layers and all(".output.adapters." in n for n in adapters)
    vit = ModelConfig(backbone="tiny:vit", module="adapter", adapter={"site": "output"})
    with pytest.raises(ConfigError, match=r"model\.adapter\.site = 'output' needs a BERT-style backbone"):
        build_task_model(build_backbone(vit, 0), vit, [Task(0, "t", ("a", "b"))], 0)


def test_a_causal_lm_classifies_from_its_last_real_token():
    backbone = build_backbone(ModelConfig(backbone="tiny-pretrained:llama-small"), 0)
    ids = backbone.tokenizer(["one plus two", "one plus two is three"], padding="max_length", max_length=8,
                             return_tensors="pt")
    with torch.no_grad():
        features = causal_lm_features(backbone.encoder, dict(ids))
        alone = causal_lm_features(backbone.encoder, {k: v[:1, :4] for k, v in ids.items()})
    assert torch.allclose(features[0], alone[0], atol=1e-5)  # padding after the text does not change it


def test_multi_modal_federation_is_deterministic_and_splits_by_label():
    config = load_config(_run("multimodal:vqa", "tiny-pretrained:vilt", clients=3))
    first, again = build_federation(config.data, 1), build_federation(config.data, 1)
    assert [h.splits for h in first.holdings][0][0][0].tolist() == [h.splits for h in again.holdings][0][0][0].tolist()
    (holding,) = first.holdings
    train, test = holding.splits[0]
    assert set(holding.dataset.labels[test]) <= set(holding.dataset.labels[train])  # stratified by label
    assert math.isclose(len(test) / (len(train) + len(test)), 0.25, abs_tol=0.05)


def test_a_parallel_decoders_target_logits_score_like_a_causal_lms():
    from rayfed.tasks.kinds import causal_from_target_logits

    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE], [IGNORE, 1, 2, 5, IGNORE]])
    target_ids = torch.tensor([[3, 4, 0], [1, 2, 5]])
    target_logits = torch.randn(2, 3, 7)
    aligned = causal_from_target_logits(target_logits, {"labels": labels})
    expected = torch.nn.functional.cross_entropy(
        torch.cat([target_logits[0, :2], target_logits[1, :3]]), torch.cat([target_ids[0, :2], target_ids[1, :3]]))
    assert TextGeneration().loss(aligned, {"labels": labels}) == pytest.approx(expected.item(), rel=1e-6)


def test_target_logits_are_placed_row_by_row_where_the_targets_are_predicted_and_gradients_flow_back():
    from rayfed.tasks.kinds import causal_from_target_logits

    # A target at position 0 (predicted at the last position, as a causal LM's shift wraps), a row without targets.
    labels = torch.tensor([[IGNORE, IGNORE, 3, 4, IGNORE, IGNORE], [2, IGNORE, 1, 2, 5, IGNORE],
                           [IGNORE] * 6, [IGNORE, 6, 6, 6, 6, 6]])
    target_logits = torch.randn(4, 5, 7, dtype=torch.float64, requires_grad=True)
    expected = torch.zeros(4, 6, 7, dtype=torch.float64)
    for row in range(4):
        positions = torch.nonzero(labels[row] != IGNORE).flatten() - 1
        expected[row, positions] = target_logits[row, :len(positions)].detach()
    aligned = causal_from_target_logits(target_logits, {"labels": labels})
    assert torch.equal(aligned, expected)
    weights = torch.randn_like(expected)
    (aligned * weights).sum().backward()
    gradient = torch.zeros_like(target_logits)
    for row in range(4):
        positions = torch.nonzero(labels[row] != IGNORE).flatten() - 1
        gradient[row, :len(positions)] = weights[row, positions]
    assert torch.equal(target_logits.grad, gradient)
