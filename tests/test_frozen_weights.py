"""A method's frozen linear and convolution weights stored in bf16 where its forwards run under bf16 autocast
(rayfed.models.frozen_weights): bitwise the same products, every forward path under the autocast, and the float32
values the actor's backbone shares restored for the next method.

A CPU computes as a GPU under ``train.autocast: bf16`` here (``bf16_on_cpu``): the engine's autocast is a CPU bf16
autocast and the store runs. A forward left outside the autocast raises there as on a GPU (a float32 activation times
a bf16 weight), and every path is compared bitwise with the same run whose frozen weights stay float32."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.actors.public import public_data
from rayfed.config import ModelConfig, load_config
from rayfed.models import build_backbone
from rayfed.models.build import build_client_model
from rayfed.models.families.clip import ClipClassifier, build_classifier
from rayfed.models.frozen_weights import FrozenWeights, frozen_layer_tensors
from rayfed.training import PublicJob, PublicPass, precision
from rayfed.zoo.registry import ZooModel

from conftest import TINY_RUN
from test_fedmosaic import _task as vqa_task

BF16 = torch.bfloat16


@pytest.fixture
def bf16_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU computes as a GPU does under ``train.autocast: bf16``: bf16 autocast, frozen weights stored in bf16."""
    monkeypatch.setattr(precision, "AUTOCAST_DEVICES", frozenset({"cuda", "cpu"}))


def _stored_and_float32(run: Callable[[], Any], monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``run()`` with the frozen weights stored in bf16, then with them left float32 (both under the autocast)."""
    stored = run()
    with monkeypatch.context() as patched:
        patched.setattr(FrozenWeights, "store_in_bf16", lambda self, model, outliving: 0)
        return stored, run()


def _assert_same(stored: Any, plain: Any, where: str = "") -> None:
    """Bitwise equal trees of tensors, numbers, strings, dicts, sequences and dataclasses."""
    if isinstance(stored, torch.Tensor):
        assert stored.dtype == plain.dtype and torch.equal(stored, plain), where
    elif isinstance(stored, dict):
        assert stored.keys() == plain.keys(), where
        for key in stored:
            _assert_same(stored[key], plain[key], f"{where}/{key}")
    elif isinstance(stored, (list, tuple)):
        assert len(stored) == len(plain), where
        for index, (first, second) in enumerate(zip(stored, plain)):
            _assert_same(first, second, f"{where}[{index}]")
    elif dataclasses.is_dataclass(stored):
        _assert_same(vars(stored), vars(plain), where)
    elif isinstance(stored, float) and math.isnan(stored):
        assert math.isnan(plain), where
    else:
        assert stored == plain, where


def _bf16_tensors(model: nn.Module) -> int:
    return sum(param.dtype == BF16 for param in model.parameters())


# The store itself ------------------------------------------------------------------------------------------------
def test_under_bf16_autocast_a_stored_layer_gives_bitwise_its_float32_outputs_and_gradients():
    """A frozen linear layer with a trained low-rank branch (LoRA's shape) and a frozen convolution: the outputs, the
    inputs' gradients and the branch's gradients are bitwise the same with the frozen tensors stored in bf16."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(24, 16), nn.Conv2d(3, 8, 3, padding=1), nn.Linear(24, 4, bias=False),
                            nn.Linear(4, 16, bias=False)])
    layers[:2].requires_grad_(False)
    nn.init.normal_(layers[3].weight)
    x, images = torch.randn(5, 24), torch.randn(2, 3, 8, 8)

    def run(stored: bool) -> list[torch.Tensor]:
        frozen = copy.deepcopy(layers)
        if stored:
            assert FrozenWeights().store_in_bf16(frozen, nn.Identity()) == 4 and _bf16_tensors(frozen) == 4
        linear, conv, lora_a, lora_b = frozen
        inputs, pixels = x.clone().requires_grad_(True), images.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=BF16):
            out = linear(inputs) + lora_b(lora_a(inputs))
            maps = conv(pixels)
        (out.float().square().sum() + maps.float().square().sum()).backward()
        return [out, maps, inputs.grad, pixels.grad, lora_a.weight.grad, lora_b.weight.grad]

    stored, plain = run(True), run(False)
    assert stored[0].dtype == BF16 and stored[4].dtype == torch.float32
    _assert_same(stored, plain)


class Tower(nn.Module):
    """A conv stem, a norm, torch's attention, a body, a trained head and a token table tied to a frozen decoder."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 16, 4, stride=4)
        self.norm = nn.LayerNorm(16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.tokens = nn.Embedding(10, 16)
        self.decoder = nn.Linear(16, 10, bias=False)
        self.decoder.weight = self.tokens.weight


def test_only_frozen_float32_tensors_of_exactly_linear_and_convolution_layers_are_stored():
    tower = Tower().requires_grad_(False)
    tower.head.requires_grad_(True)
    tower.body.bias.requires_grad_(True)  # BitFit: the body's bias trains, its weight does not
    assert FrozenWeights().store_in_bf16(tower, nn.Identity()) == 3
    assert {name for name, param in tower.named_parameters() if param.dtype == BF16} == {
        "patches.weight", "patches.bias", "body.weight"}
    # the tied decoder's table is looked up too, and torch's attention reads its own projections: float32
    assert tower.tokens.weight.dtype == tower.attention.out_proj.weight.dtype == torch.float32
    assert frozen_layer_tensors(tower) == []  # stored once: nothing float32 is left to store


def test_restore_puts_back_the_float32_values_the_backbone_shares_and_the_next_method_trains_them():
    config = ModelConfig(backbone="tiny:vit", image_size=8, lora={"rank": 2, "alpha": 4})
    backbone = build_backbone(config, seed=0)
    before = [(param, param.detach().clone()) for param in backbone.encoder.parameters()]
    frozen = FrozenWeights()
    over_a_copy = build_client_model(backbone, config, 3, seed=0)
    assert frozen.store_in_bf16(over_a_copy, backbone.encoder) > 0 and _bf16_tensors(backbone.encoder) == 0
    over_itself = build_client_model(backbone, config, 3, seed=0, private_copy=False)
    stored = frozen.store_in_bf16(over_itself, backbone.encoder)
    assert stored > 0 and _bf16_tensors(backbone.encoder) == stored
    frozen.restore()
    assert all(param.dtype == value.dtype and torch.equal(param, value) for param, value in before)
    assert not any(hasattr(module, "int8_original_dtype") for module in backbone.encoder.modules())
    # the next method trains the whole backbone (a copy of it): nothing is frozen, so nothing is stored, and it trains
    full = build_client_model(backbone, config.model_copy(update={"module": "full", "lora": None}), 3, seed=1)
    assert frozen.store_in_bf16(full, backbone.encoder) == 0
    weights = [module.weight for name, module in full.encoder.named_modules()
               if type(module) is nn.Linear and "lora_" not in name]
    starts = [weight.detach().clone() for weight in weights]
    optimizer = torch.optim.SGD(full.parameters(), lr=0.1)
    full(torch.rand(2, 3, 8, 8)).square().sum().backward()
    optimizer.step()
    assert all(weight.dtype == torch.float32 and not torch.equal(weight, start)
               for weight, start in zip(weights, starts))


def test_weights_are_stored_only_on_a_gpu_under_train_autocast_bf16(monkeypatch):
    """A CPU computes in float32 (the offline numbers stay bitwise), and so does ``train.autocast: off``."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert precision.computes_in_bf16(gpu, "bf16") and not precision.computes_in_bf16(gpu, "off")
    assert not precision.computes_in_bf16(cpu, "bf16")
    actor = ClientActor(copy.deepcopy(TINY_RUN), [0])
    actor.start_method(0)
    assert _bf16_tensors(actor.model) == 0
    monkeypatch.setattr(precision, "AUTOCAST_DEVICES", frozenset({"cuda", "cpu"}))
    for autocast, stored in (("off", False), ("bf16", True)):
        run = copy.deepcopy(TINY_RUN)
        run["train"]["autocast"] = autocast
        actor = ClientActor(run, [0])
        actor.start_method(0)
        assert (_bf16_tensors(actor.model) > 0) is stored


# Models that read a weight's dtype -------------------------------------------------------------------------------
def _tiny_open_clip() -> ZooModel:
    import open_clip

    torch.manual_seed(0)
    vision = {"image_size": 16, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16}
    text = {"context_length": 12, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2}
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
    return ZooModel(model.eval().requires_grad_(False), open_clip.tokenizer.SimpleTokenizer(context_length=12))


@pytest.mark.parametrize("clip", ["open_clip", "tiny-pretrained:clip"])
def test_a_clip_classifier_scores_bitwise_the_same_with_its_towers_stored_in_bf16(clip):
    """open_clip's text tower computes in its first block's weight dtype (``get_cast_dtype``): it stays float32."""
    spaces = [("red circle", "blue square", "green star")]
    if clip == "open_clip":
        classifier = ClipClassifier(_tiny_open_clip(), spaces)
    else:
        classifier = build_classifier(ModelConfig(backbone=clip, lora=None), spaces)
    images = torch.rand(3, 3, 16, 16)
    stored = copy.deepcopy(classifier)
    assert FrozenWeights().store_in_bf16(stored, nn.Identity()) > 0
    if clip == "open_clip":
        assert stored.clip.transformer.get_cast_dtype() == torch.float32
    with torch.autocast("cpu", dtype=BF16), torch.no_grad():
        _assert_same(stored(images), classifier(images))


def test_a_causal_lm_whose_head_is_its_token_table_gives_bitwise_its_logits_and_generations():
    """llama:tiny ties its LM head to its token embeddings, which a lookup reads outside autocast: float32 stays."""
    encoder = build_backbone(ModelConfig(backbone="llama:tiny"), seed=0).encoder
    stored = copy.deepcopy(encoder)
    assert FrozenWeights().store_in_bf16(stored, nn.Identity()) > 0 and _bf16_tensors(stored) > 0
    assert stored.lm_head.weight is stored.model.embed_tokens.weight and stored.lm_head.weight.dtype == torch.float32
    torch.manual_seed(0)
    prompts = {"input_ids": torch.randint(3, 200, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    prompts["attention_mask"][0, :2] = 0  # left-padded, as the engine's prompts are

    def outputs(model: nn.Module) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=BF16), torch.no_grad():
            return [model(**prompts).logits, model.generate(**prompts, max_new_tokens=5, do_sample=False,
                                                            pad_token_id=0)]

    _assert_same(outputs(stored), outputs(encoder))


# Every forward path of the engine and the seed methods -------------------------------------------------------------
def test_training_evaluation_and_the_representation_shift_compute_bitwise_the_same(bf16_on_cpu, monkeypatch):
    """A LoRA model's local update, its evaluation and ``federation.representation_shift`` (the head's features)."""
    run = copy.deepcopy(TINY_RUN)
    run["federation"]["representation_shift"] = True

    def rounds() -> tuple[Any, ...]:
        actor = ClientActor(run, [0, 1])
        shared = actor.start_method(0)
        payloads = {0: shared, 1: shared}
        uploads = actor.train(0, [0, 1], payloads)
        return _bf16_tensors(actor.model), uploads, actor.evaluate(1, payloads)

    stored, plain = _stored_and_float32(rounds, monkeypatch)
    assert stored[0] > 0 and plain[0] == 0 and "rep_shift" in stored[2][0]
    _assert_same(stored[1:], plain[1:])


def test_feddat_s_two_step_losses_over_its_frozen_adapters_compute_bitwise_the_same(bf16_on_cpu, monkeypatch):
    """FedDAT on ViLT: custom losses in two phases, the received adapter Â_s loaded into frozen (stored) layers every
    round, the dual-adapter teacher's views; the representation shift of a model of images and texts."""
    from test_feddat import RUN

    run = copy.deepcopy(RUN)
    run["federation"]["representation_shift"] = True

    def rounds() -> tuple[Any, ...]:
        actor = ClientActor(run, [0, 1])
        shared = actor.start_method(0)
        frozen_adapter = next(p for n, p in actor.model.named_parameters() if ".adapters.frozen." in n)
        payloads = {0: shared, 1: shared}
        uploads = actor.train(0, [0, 1], payloads)
        return frozen_adapter.dtype, uploads, actor.evaluate(1, payloads)

    stored, plain = _stored_and_float32(rounds, monkeypatch)
    assert stored[0] == BF16 and plain[0] == torch.float32
    _assert_same(stored[1:], plain[1:])


MOSAIC = {
    "name": "mosaic", "seed": 5,
    "data": {"tasks": [vqa_task("a", 0, 0, "color"), vqa_task("b", 1, 1, "color")],
             "public": {"source": "multimodal:shapes", "kind": "text_generation", "max_text_length": 32,
                        "options": {"num_samples": 8, "styles": ["plain"]}}},
    "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 4, "alpha": 8}},
    "federation": {"rounds": 1, "clients_per_round": 2},
    "train": {"local_steps": 1, "batch_size": 4, "lr": 0.002, "optimizer": "adamw", "eval_batch_size": 64},
    "methods": [{"name": "fedmosaic", "grad_interval": 1, "align_samples": 8}],
    "placement": {"executor": "local", "clients_per_actor": 2},
}


def test_fedmosaic_s_alignment_relevance_gradients_and_generations_compute_bitwise_the_same(bf16_on_cpu, monkeypatch):
    """FedMosaic on a tiny LLaVA: the alignment's forward over the public rows, the local update's loss with RELA's
    gradient of a frozen layer, and the evaluation's greedy generations."""

    def rounds() -> tuple[Any, ...]:
        actor = ClientActor(load_config(MOSAIC), [0, 1])
        actor.start_method(0)
        prepared = actor.pre_federation(0)
        uploads = actor.train(0, [0, 1], {0: None, 1: None})
        return _bf16_tensors(actor.model), prepared, uploads, actor.evaluate(1, {0: None, 1: None})

    stored, plain = _stored_and_float32(rounds, monkeypatch)
    assert stored[0] > 0 and plain[0] == 0
    _assert_same(stored[1:], plain[1:])


def test_the_public_passes_logits_and_distillations_compute_bitwise_the_same(bf16_on_cpu, monkeypatch):
    """A public pass's answer logits and its training of two adapters together (grouped LoRA), as FedMKT, TAKFL and
    PerAda run them."""
    run = {**MOSAIC, "methods": [{"name": "fedmkt", "public_samples": 8}]}

    def passes() -> tuple[Any, ...]:
        actor = ClientActor(load_config(run), [0, 1])
        start = actor.start_method(0)
        task, columns = public_data(actor.config, actor.backbone)
        stage = PublicPass("", actor.model, columns, task, actor.train_config, actor.device, actor.config.seed, 0)
        rows = stage.rows(8)
        logits = stage.answer_logits(start, rows)
        moved = {name: value + 0.01 for name, value in start.items()}
        jobs = [PublicJob(start, rows, logits, "a"), PublicJob(moved, rows, logits, "b")]

        def loss(student: torch.Tensor, target: torch.Tensor, _answers: torch.Tensor) -> torch.Tensor:
            return (student - target).square().mean()

        trained = stage.train_each(jobs, loss, epochs=1, batch_size=4, lr=0.01)
        return _bf16_tensors(actor.model), logits, trained

    stored, plain = _stored_and_float32(passes, monkeypatch)
    assert stored[0] > 0 and plain[0] == 0
    _assert_same(stored[1:], plain[1:])


def test_tap_s_updates_and_post_fl_distillation_compute_bitwise_the_same(bf16_on_cpu, monkeypatch):
    """TAP on FLAVA: the local updates of W and X, the post-FL stage (post-training, then distillation from the
    teacher's outputs under its own values) and the evaluation, the parallel decoder's generations included."""
    from test_tap import RUN

    run = copy.deepcopy(RUN)
    run["data"]["tasks"] = [{**task, "clients": [0]} for task in run["data"]["tasks"] if task["name"] == "vqa"]
    run["methods"][0]["post_fl_microbatches"] = 1
    run["federation"]["clients_per_round"] = 1
    run["train"]["local_steps"] = 1

    def rounds() -> tuple[Any, ...]:
        actor = ClientActor(load_config(run).to_dict(), [0])  # visual question answering as text generation
        shared = actor.start_method(0)
        driver = DriverActor(load_config(run))
        driver.start_method(0, [""], shared, actor.task_tags())
        uploads = actor.train(0, [0], driver.payloads([0]))
        return _bf16_tensors(actor.model), uploads, actor.finish(1, driver.payloads([0]), 0)

    stored, plain = _stored_and_float32(rounds, monkeypatch)
    assert stored[0] > 0 and plain[0] == 0
    _assert_same(stored[1:], plain[1:])
