"""FedDAT (docs/feddat.md): the dual-adapter teacher, mutual distillation, what is sent and kept, the PEFT
baselines' modules and counts, the heterogeneity generators and the configs."""

from __future__ import annotations

import copy
import hashlib
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.config import ModelConfig, load_config
from rayfed.data import multimodal, multimodal_texts
from rayfed.errors import ConfigError
from rayfed.method import Upload
from rayfed.models import IMAGE, TEXT, Backbone, build_client_model, vilt_features
from rayfed.models.peft.modules import Bottleneck, MlpHead, set_adapter_mix
from rayfed.tasks import Task
from rayfed.training import ClientContext

from conftest import compiled_update_gap, load_data, made_instances, method_class

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "feddat"
FEDDAT_ADAPTER = {"dim": 4, "site": "output", "activation": "relu", "init": "normal"}
RUN = {
    "name": "feddat-tiny",
    "seed": 1,
    "data": {
        "source": "multimodal:vqa",
        "options": {"num_samples": 48, "subsets": [{"styles": ["plain"]}, {"styles": ["noisy"], "wording": 2},
                                                   {"styles": ["sketch"], "question_types": ["color", "count"]}]},
        "num_clients": 3, "test_fraction": 0.5, "partition": {"name": "natural", "column": "subset"},
    },
    "model": {"backbone": "tiny-pretrained:vilt", "module": "adapter", "adapter": FEDDAT_ADAPTER, "head": "mlp"},
    "federation": {"rounds": 4, "clients_per_round": 3},
    "train": {"local_steps": 2, "batch_size": 8, "optimizer": "adamw", "lr": 0.01, "weight_decay": 0.01},
    "methods": [{"name": "feddat"}],
    "placement": {"clients_per_actor": 3, "cpus_per_actor": 1},
}


def _run(*methods: dict, **train) -> dict:
    run = copy.deepcopy(RUN)
    run["methods"] = list(methods) or run["methods"]
    run["train"].update(train)
    return run


def _actor(run: dict, clients=(0, 1, 2)) -> ClientActor:
    return ClientActor(load_config(run).to_dict(), list(clients))


def _method(**params):
    cls = method_class("feddat")
    return cls(cls.Params(**params))


def _names(params, part: str) -> list[str]:
    return sorted(n for n in params if f".adapters.{part}." in n)


# Parameter counts on ViLT-B/32 (meta device: nothing is allocated or downloaded) -------------------------
def _vilt_b32_counts(method, **model) -> tuple[int, int]:
    with torch.device("meta"):
        encoder = transformers.ViltModel(transformers.ViltConfig()).requires_grad_(False)
        backbone = Backbone(encoder, 768, 384, 3, vilt_features, frozenset({IMAGE, TEXT}), lora_targets=("query", "value"))
        built = method.build_model(backbone, ModelConfig(head="mlp", **model), [Task(0, "vqa", ("a",) * 100)], 0)
    trainable = {n: p for n, p in built.named_parameters() if p.requires_grad}
    shared = sum(p.numel() for n, p in trainable.items() if method.is_shared(n))
    return shared, sum(p.numel() for p in trainable.values())


VILT_ADAPTER = {"dim": 48, "site": "output", "activation": "relu", "init": "normal"}


@pytest.mark.parametrize(("variant", "model", "uploaded"), [
    ("feddat", {"module": "adapter", "adapter": VILT_ADAPTER}, 894_528),  # 12 x (768*48 + 48 + 48*768 + 768)
    ("peft", {"module": "adapter", "adapter": VILT_ADAPTER}, 894_528),    # Adapter: the same upload
    ("peft", {"module": "lora", "lora": {"rank": 16, "alpha": 16}}, 589_824),  # 12 x 2 x (2 x 768 x 16), q and v
    ("peft", {"module": "prompt"}, 599_424),  # 2 x (5*768 + 768*192 + 192 + 192*768 + 768)
    ("peft", {"module": "bias"}, 104_448),  # "0.10M" (Table 2)
])
def test_uploads_per_round_on_vilt_b32_are_the_papers(variant, model, uploaded):
    shared, trainable = _vilt_b32_counts(_method(variant=variant), **model)
    assert shared == uploaded
    head = 768 * 1536 + 1536 + 2 * 1536 + 1536 * 100 + 100  # Linear(d, 2d), LayerNorm(2d), Linear(2d, 100)
    extra = 894_528 if variant == "feddat" else 0  # A_c is trained too; the frozen Â_s is not
    assert trainable == uploaded + head + extra


def test_feddat_keeps_three_adapters_per_layer_and_sends_only_the_shared_one():
    method = _method()
    with torch.device("meta"):
        encoder = transformers.ViltModel(transformers.ViltConfig()).requires_grad_(False)
        backbone = Backbone(encoder, 768, 384, 3, vilt_features, frozenset({IMAGE, TEXT}))
        model = method.build_model(backbone, ModelConfig(module="adapter", adapter=VILT_ADAPTER, head="mlp"),
                                   [Task(0, "vqa", ("a",) * 10)], 0)
    params = dict(model.named_parameters())
    for part, trainable in (("shared", True), ("frozen", False), ("local", True)):
        names = _names(params, part)
        assert len(names) == 12 * 4 and all(params[n].requires_grad == trainable for n in names)
    assert {n for n in params if params[n].requires_grad and method.is_shared(n)} == set(_names(params, "shared"))
    adapter = model.encoder.encoder.layer[0].output.adapters["shared"]
    assert adapter.down.out_features == 48 and adapter.activation == "relu"  # r = d / 16
    assert not method.is_shared("head.0.weight") and not method.is_shared(_names(params, "local")[0])


def test_the_papers_adapter_is_relu_with_normal_init_and_the_engines_default_is_unchanged():
    torch.manual_seed(0)
    paper = Bottleneck(768, 48, "relu", "normal")
    for linear in (paper.down, paper.up):
        assert abs(linear.weight.std().item() - 0.02) < 0.001 and torch.count_nonzero(linear.bias) == 0
    z = torch.randn(3, 768)
    assert torch.equal(paper(z), z + paper.up(torch.relu(paper.down(z))))
    engine = Bottleneck(768, 48)  # GELU, zero up-projection: the identity at step 0
    assert engine.activation == "gelu" and torch.count_nonzero(engine.up.weight) == 0 and torch.equal(engine(z), z)
    head = MlpHead(64, 7)
    assert [type(m) for m in head] == [torch.nn.Linear, torch.nn.LayerNorm, torch.nn.GELU, torch.nn.Linear]
    assert head[0].out_features == 128 and head[3].out_features == 7


# The dual-adapter teacher and mutual distillation (tiny pretrained ViLT, in process) ------------------
@pytest.fixture(scope="module")
def actor() -> ClientActor:
    return _actor(_run())


@pytest.fixture
def started(actor):
    """FedDAT started on the module's actor: (actor, the initial A_s payload)."""
    actor.method = None
    return actor, actor.start_method(0)


def _batch(actor: ClientActor, client: int = 0, rows: int = 6) -> dict[str, torch.Tensor]:
    return {k: v[:rows] for k, v in actor.data[client].parts[0].train.items()}


def test_dat_equals_the_shared_adapter_alone_when_the_three_adapters_are_equal(started):
    actor, shared = started
    model = actor.model
    equal = {**shared, **{n.replace(".shared.", ".frozen."): v for n, v in shared.items()},
             **{n.replace(".shared.", ".local."): v for n, v in shared.items()}}
    model.load_trainable(equal)
    model.eval()
    batch = _batch(actor)
    outputs = {}
    for view, mix in (("student", None), ("dat", {"frozen": 0.5, "local": 0.5}), ("moved", {"local": 1.0})):
        if view == "moved":
            model.load_trainable({n: v + 0.1 for n, v in equal.items() if ".local." in n})
        set_adapter_mix(model, mix)
        torch.manual_seed(0)  # ViLT draws a permutation of the patches in every forward
        with torch.no_grad():
            outputs[view] = model(batch)
    set_adapter_mix(model, None)
    student, dat, other = outputs["student"], outputs["dat"], outputs["moved"]
    assert torch.equal(dat, student)
    assert not torch.allclose(other, student)  # the mixture does read the local adapter


def test_training_leaves_the_frozen_copy_bitwise_the_received_adapter_and_uploads_only_it(started):
    actor, shared = started
    received = {n: v + 0.01 for n, v in shared.items()}  # a payload unlike the model's initial values
    [upload] = actor.train(0, [0], {0: received})
    params = dict(actor.model.named_parameters())
    frozen = _names(params, "frozen")
    assert frozen and all(not params[n].requires_grad for n in frozen)
    assert all(torch.equal(params[n], received[n.replace(".frozen.", ".shared.")]) for n in frozen)
    assert set(upload.tensors) == {"shared"} and set(upload.tensors["shared"]) == set(received)
    assert upload.weight == 1.0  # a uniform mean (Algorithm 1)
    state = actor.states[0]["personal"]
    assert set(state) == set(_names(state, "local")) | {n for n in state if n.startswith("head.")}
    assert any(not torch.equal(upload.tensors["shared"][n], received[n]) for n in received)


def test_the_local_adapter_and_the_head_persist_across_rounds(started, monkeypatch):
    actor, shared = started
    actor.train(0, [1], {1: shared})
    after_round_0 = {n: v.clone() for n, v in actor.states[1]["personal"].items()}
    initial = actor.initial[1]
    assert all(not torch.equal(after_round_0[n], initial[n]) for n in _names(after_round_0, "local"))
    started_with = []
    original = ClientContext.train
    monkeypatch.setattr(ClientContext, "train", lambda self, params, **kw: started_with.append(params) or original(self, params, **kw))
    received = {n: v * 0.5 for n, v in shared.items()}
    actor.train(1, [1], {1: received})
    [start] = started_with
    assert all(torch.equal(start[n], v) for n, v in after_round_0.items())  # A_c and the head as left
    assert all(torch.equal(start[n], v) for n, v in received.items())  # A_s as received
    views = actor.method.eval_views(actor.states[1], received)
    assert set(views) == {"", "dat", "local"}
    assert all(torch.equal(views["local"][n], actor.states[1]["personal"][n]) for n in _names(after_round_0, "local"))


def _gradient_order(actor, shared, client: int, **method_fields) -> tuple[dict, list[str]]:
    """Train ``client`` one round with ``method_fields``; the model's parameters and the names of those that
    received a gradient, in the order they received it."""
    params = dict(actor.model.named_parameters())
    events: list[str] = []
    handles = [params[n].register_hook(lambda grad, n=n: events.append(n)) for n in params if params[n].requires_grad]
    try:
        actor.method = _method(**method_fields)
        actor.train(0, [client], {client: shared})
    finally:
        for handle in handles:
            handle.remove()
    return params, events


def test_teachers_get_no_gradient_and_each_step_moves_only_its_adapter(started):
    actor, shared = started
    # alpha = beta = 1 from round 0: both KD terms on
    params, events = _gradient_order(actor, shared, 2, kd_schedule="constant")
    kinds = ["shared" if ".shared." in n else "local" if ".local." in n else "head" for n in events]
    per_step = len(_names(params, "shared")) + len(_names(params, "local")) + 2 * len([n for n in params if n.startswith("head.")])
    assert len(kinds) == 2 * per_step  # two local steps, each: A_s + head, then A_c + head, nothing else
    heads = len([n for n in params if n.startswith("head.")])
    student_step = len(_names(params, "shared")) + heads
    for step in (kinds[:per_step], kinds[per_step:]):
        assert set(step[:student_step]) == {"shared", "head"} and set(step[student_step:]) == {"local", "head"}


def test_the_joint_update_takes_one_step_per_batch_on_both_objectives(started):
    actor, shared = started
    params, events = _gradient_order(actor, shared, 0, update="joint", kd_schedule="constant")
    trained = [n for n in params if params[n].requires_grad]
    assert sorted(events) == sorted(2 * trained)  # two local steps; the head's two losses meet in one backward
    assert not _names(events, "frozen")


def test_with_alpha_zero_and_a_frozen_head_the_first_student_step_is_the_adapter_baselines(actor):
    results = {}
    for label, entry in (("feddat", {"name": "feddat", "alpha": 0.0, "objective_scale": 1.0}),
                         ("adapter", {"name": "feddat", "variant": "peft"})):
        run = _run(entry, local_steps=1)
        one = _actor(run, [0])
        one.start_method(0)
        one.model.head.requires_grad_(False)
        shared = {n: v for n, v in one.model.trainable_params().items() if ".shared." in n}
        one.states[0] = one.method.init_client(one.model.trainable_params())
        [upload] = one.train(0, [0], {0: shared})
        results[label] = (shared, upload.tensors["shared"])
    (start, feddat), (start_adapter, adapter) = results["feddat"], results["adapter"]
    assert set(feddat) == set(adapter) and all(torch.equal(start[n], start_adapter[n]) for n in start)
    assert all(torch.equal(feddat[n], adapter[n]) for n in feddat)
    assert any(not torch.equal(feddat[n], start[n]) for n in feddat)


def test_kd_weights_ramp_up_over_the_first_quarter_of_the_rounds():
    method = _method(alpha=2.0)
    method.rounds = 20  # t_r = 5
    weights = [method.kd_weight(2.0, r) for r in range(7)]
    assert weights[0] == pytest.approx(2.0 * math.exp(-5 * 0.8**2))
    assert weights[4] == weights[5] == weights[6] == 2.0 and all(a < b for a, b in zip(weights[:4], weights[1:5]))
    assert _method(kd_schedule="constant").kd_weight(1.5, 0) == 1.5
    assert _method(rampup_rounds=2).kd_weight(1.0, 0) == pytest.approx(math.exp(-5 * 0.25))


def test_no_mkd_is_feddat_with_beta_zero_and_the_ablations_hold_their_adapters():
    uploads = {}
    for label, entry in (("no_mkd", {"name": "feddat", "variant": "no_mkd"}), ("beta0", {"name": "feddat", "beta": 0.0})):
        one = _actor(_run(entry), [0])
        shared = one.start_method(0)
        one.train(0, [0], {0: shared})
        uploads[label] = one.states[0]["personal"]
    assert all(torch.equal(uploads["no_mkd"][n], v) for n, v in uploads["beta0"].items())
    for variant, held in (("no_frozen", {"shared", "local"}), ("no_local", {"shared", "frozen"})):
        method = _method(variant=variant)
        model = method.build_model(
            _actor_backbone(), load_config(_run()).model, [Task(0, "vqa", multimodal.VQA_ANSWERS)], 0)
        assert {n.split(".adapters.")[1].split(".")[0] for n, _ in model.named_parameters() if ".adapters." in n} == held
        assert set(method.eval_views({"personal": {}}, {})) == ({"", "local"} if variant == "no_frozen" else {""})


def _actor_backbone():
    from rayfed.models import build_backbone

    return build_backbone(load_config(_run()).model, 0)


def test_uniform_aggregation_of_identical_uploads_is_the_identity():
    method = _method()
    value = {"x.adapters.shared.w": torch.randn(3, 2)}
    uploads = [Upload(cid, 1, {"shared": {k: v.clone() for k, v in value.items()}}, 0.0) for cid in range(3)]
    server = method.aggregate(method.init_server({k: torch.zeros_like(v) for k, v in value.items()}), uploads)
    assert torch.equal(server["global"]["x.adapters.shared.w"], value["x.adapters.shared.w"])


def _trajectory(run: dict, packing: list[list[int]], rounds: int = 2) -> tuple[dict, dict]:
    """Drive FedDAT for ``rounds`` rounds with clients packed into in-process actors as ``packing`` says."""
    config = load_config(run)
    actors = [ClientActor(config.to_dict(), clients) for clients in packing]
    driver = DriverActor(config.to_dict())
    initial = [a.start_method(0) for a in actors]
    driver.start_method(0, [""], initial[0], actors[0].task_tags())
    every = [cid for clients in packing for cid in clients]
    for round_idx in range(rounds):
        parts = [a.train_round(round_idx, clients, driver.payloads(clients), {c: 1.0 for c in clients})
                 for a, clients in zip(actors, packing)]
        driver.aggregate(*parts)
    metrics = {}
    for a, clients in zip(actors, packing):
        metrics.update(a.evaluate(rounds, driver.payloads(clients, False)))
    return driver.get_state()["global"], metrics


def test_packing_clients_into_actors_does_not_change_feddat():
    run = _run()
    together, metrics = _trajectory(run, [[0, 1, 2]])
    apart, other_metrics = _trajectory(run, [[0], [1, 2]])
    assert set(together) == set(apart) and all(torch.equal(together[n], apart[n]) for n in together)
    assert metrics == other_metrics
    assert {"local_acc", "local_acc@dat", "local_acc@local"} <= set(metrics[0])


def test_an_evaluation_draws_vilts_patch_order_from_its_own_stream_and_leaves_the_process_generator(started):
    actor, shared = started
    payloads = {cid: shared for cid in actor.client_ids}
    torch.manual_seed(1)
    first = actor.evaluate(0, payloads)
    torch.manual_seed(2)
    torch.rand(7)  # the process's generator elsewhere: another actor's history, another packing
    before = torch.random.get_rng_state()
    assert actor.evaluate(0, payloads) == first
    assert torch.equal(torch.random.get_rng_state(), before)


def test_feddat_needs_the_adapter_module():
    run = _run()
    run["model"]["module"] = "lora"
    with pytest.raises(ConfigError, match=r"feddat\) trains adapters, but model.module = 'lora'"):
        _actor(run, [0]).start_method(0)


# The baselines' modules -----------------------------------------------------------------------------
def test_bias_tuning_trains_every_bias_and_nothing_else(actor):
    backbone = actor.backbone
    model = build_client_model(backbone, ModelConfig(backbone="tiny-pretrained:vilt", module="bias"), 5, 0)
    trainable = model.trainable_names()
    encoder = [n for n in trainable if n.startswith("encoder.")]
    assert encoder and all("bias" in n for n in encoder)
    assert len(encoder) == sum("bias" in n for n, _ in model.encoder.named_parameters())
    no_bias = Backbone(torch.nn.Linear(4, 4, bias=False), 4)
    with pytest.raises(ConfigError, match=r"model.module = 'bias' trains the backbone's bias parameters, but this "
                                          r"backbone has none"):
        build_client_model(no_bias, ModelConfig(module="bias"), 3, 0)


def test_prompt_tokens_per_modality_sit_after_each_first_token_and_are_attended(actor):
    config = ModelConfig(backbone="tiny-pretrained:vilt", module="prompt", prompt={"tokens": 3, "hidden": 8})
    model = build_client_model(actor.backbone, config, 5, 0)
    prompts = [n for n in model.trainable_names() if n.startswith("encoder.")]
    assert sorted({n.split(".")[3] for n in prompts}) == ["image", "text"]
    assert sum(p.numel() for n, p in model.named_parameters() if n in prompts) == 2 * (3 * 64 + 64 * 8 + 8 + 8 * 64 + 64)
    batch = model.inputs(_batch(actor))
    pixel_mask = torch.ones(len(batch["pixel_values"]), 32, 32, dtype=torch.long)
    inputs = (batch["input_ids"], batch["attention_mask"], None, batch["pixel_values"], pixel_mask, None, None)
    embeddings = model.encoder.embeddings
    with torch.no_grad():
        torch.manual_seed(0)  # ViLT draws a permutation of the patches
        plain, _ = embeddings.embeddings(*inputs)
        torch.manual_seed(0)
        prompted, mask = embeddings(*inputs)
    text = batch["input_ids"].shape[1]
    assert prompted.shape[1] == plain.shape[1] + 6 and mask[:, 1:4].all() and mask[:, text + 4:text + 7].all()
    assert torch.equal(prompted[:, 0], plain[:, 0]) and torch.equal(prompted[:, 4:text + 4], plain[:, 1:text + 1])
    assert torch.equal(prompted[:, 1:4], embeddings.prompts["text"]().expand(len(plain), -1, -1))
    with pytest.raises(ConfigError, match=r"model.module = 'prompt' prepends prompt tokens per modality at ViLT's"):
        build_client_model(_tiny_vit(), ModelConfig(module="prompt"), 3, 0)


def _tiny_vit() -> Backbone:
    from rayfed.models import build_backbone

    return build_backbone(ModelConfig(backbone="tiny:vit"), 0)


# Data: the three heterogeneity benchmarks' generators -------------------------------------------------
def _fingerprint(columns: dict) -> str:
    digest = hashlib.sha256()
    for key in ("image", "label", "count"):
        digest.update(np.ascontiguousarray(np.asarray(columns[key])).tobytes())
    for key in ("text", "question_type", "domain"):
        digest.update("|".join(map(str, columns[key])).encode())
    return digest.hexdigest()[:16]


def test_existing_vqa_samples_and_the_vocabulary_are_unchanged():
    """Fingerprints of the generator before the FedDAT options existed (shipped tokenizers and configs use it)."""
    assert _fingerprint(multimodal.vqa_columns(48, seed=5)) == "51f2e77ce3d4dad8"
    sketch = multimodal.Distribution(multimodal.CLASSES[:8], ("sketch",), ("vqa",))
    assert _fingerprint(multimodal.vqa_columns(48, seed=5, question_types=("count", "color"), distribution=sketch)) \
        == "a96a8b4642ef128f"
    assert hashlib.sha256("|".join(multimodal.vocabulary()).encode()).hexdigest()[:16] == "b4d4e2b19e7f93b6"


def test_new_wordings_and_question_functions_use_only_known_words_and_answers():
    vocabulary = set(multimodal.vocabulary())
    questions = [q for wordings in multimodal.VQA_WORDINGS.values() for q in wordings]
    extra = multimodal.vqa_columns(200, seed=0, question_types=multimodal.EXTRA_QUESTION_TYPES)
    assert set(extra["question_type"]) == set(multimodal.EXTRA_QUESTION_TYPES)
    for text in questions + list(extra["text"]):
        assert set(multimodal_texts._split_words(text)) <= vocabulary, text
    assert {a for a, kind in zip(extra["class_name"], extra["question_type"]) if kind == "arithmetic"} <= {"two", "three", "four"}
    plain, worded = multimodal.vqa_columns(32, seed=3), multimodal.vqa_columns(32, seed=3, wording=3)
    assert np.array_equal(plain["image"], worded["image"]) and np.array_equal(plain["label"], worded["label"])
    assert all(a != b for a, b in zip(plain["text"], worded["text"]))
    with pytest.raises(ConfigError, match=r"wording = 5 is invalid"):
        multimodal.vqa_columns(4, seed=0, wording=5)


def test_subsets_make_one_client_each_with_its_own_style_questions_and_size():
    subsets = [{"styles": ["plain"], "question_types": ["count"], "num_samples": 30},
               {"styles": ["sketch"], "question_types": ["knowledge"], "wording": 1}]
    dataset = load_data("multimodal:vqa", synthetic={"num_samples": 20, "subsets": subsets}, group_column="subset")
    assert np.bincount(dataset.groups).tolist() == [30, 20] and dataset.domains == ("0", "1")
    texts = dataset.text
    assert all(t == "how many objects are there?" for t in texts[:30])
    assert len(set(texts[30:])) > 3 and not any("how many" in t for t in texts[30:])
    again = load_data("multimodal:vqa", synthetic={"num_samples": 20, "subsets": subsets}, group_column="subset")
    assert np.array_equal(dataset.images, again.images)
    with pytest.raises(ConfigError, match=r"data.options.subsets\[0\] has no option 'style'"):
        load_data("multimodal:vqa", synthetic={"subsets": [{"style": ["plain"]}]})
    with pytest.raises(ConfigError, match=r"data.options.subsets\[0\].question_types"):
        load_data("multimodal:vqa", synthetic={"subsets": [{"question_types": ["why"]}]})


# Configs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_feddat_config_loads_and_validates(path):
    config = load_config(path)
    labels = [m.label for m in config.methods]
    assert "FedDAT" in labels
    if path.name.startswith("paper_") and not path.stem.endswith("_offline"):  # twins: tests/test_offline_twins.py
        assert config.model.backbone == "hf:dandelin/vilt-b32-mlm" and config.model.adapter.dim == 48
        assert config.federation.rounds == 20 and config.train.batch_size == 32


def test_the_tune_config_sweeps_tau_and_the_kd_weights(tmp_path):
    from rayfed.tune.sweep import _Sweep

    sweep = _Sweep.build(load_config(CONFIGS.parent / "tune" / "feddat_kd.yaml"), tmp_path, None)
    assert {"methods.0.tau", "methods.0.alpha", "methods.0.beta"} <= set(sweep.spec.space)
    assert sweep.spec.metric.startswith("FedDAT/")


def test_a_compiled_feddat_update_uploads_the_eager_updates_numbers(monkeypatch):
    # float32 sums in another order: round-off of about 1e-7 relative per operation; a wrong path, batch or lr
    # moves the update by its own size
    assert compiled_update_gap(_run(), [0], monkeypatch) < 1e-4


@pytest.mark.parametrize("variant", ["feddat", "no_local"])
def test_a_replayed_feddat_step_trains_both_phases_as_the_eager_one(replayed_on_cpu, variant):
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = _run({"name": "feddat", "variant": variant, "alpha": 1.0, "beta": 1.0}, optimizer="sgd", momentum=0.9,
               weight_decay=0.0)
    gap, moved = compiled_gap(run, [0, 1], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 1  # one step for both clients
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)  # none in a step
    assert moved > 1e-4 and gap < 1e-5  # a wrong phase, trained set, loss or rate moves the update by its size


def test_a_replayed_prompt_tuned_step_embeds_its_images_without_reading_back(replayed_on_cpu):
    # prompt tuning wraps ViLT's embeddings (PromptedViltEmbeddings); its unpadded images still skip transformers'
    # padded path, which reads each image's size back to the host (about 6 reads an image)
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = _run({"name": "feddat", "variant": "peft", "model": {"module": "prompt"}}, optimizer="sgd", momentum=0.9)
    gap, moved = compiled_gap(run, [0, 1], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 1
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)
    assert moved > 1e-4 and gap < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["feddat", "no_local"])
def test_a_captured_feddat_update_uploads_the_eager_updates_numbers(monkeypatch, variant):
    # Both phases (the student's KD from the DAT mix, then the local adapter's) in one graph, each with its optimizer
    from rayfed.benchmarks.fast_steps_check import compiled_gap
    from rayfed.training.plans import graphed_step

    captured = made_instances(monkeypatch, graphed_step, "GraphedStep")
    run = _run({"name": "feddat", "variant": variant, "alpha": 1.0, "beta": 1.0})
    gap, moved = compiled_gap(run, [0, 1], mode="cuda_graphs", overrides=["train.autocast=off"])
    assert len(captured) == 1  # one graph for both clients' steps
    assert moved > 1e-4 and gap < 1e-3  # float32: a wrong phase, loss or optimizer moves the update by its size
