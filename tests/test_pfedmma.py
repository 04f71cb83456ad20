"""pFedMMA, PromptFL and CLIP zero-shot (docs/pfedmma.md): adapter structure and counts, gradient scale,
communication, base/novel label spaces and metrics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from rayfed.models.families.clip import build_classifier
from rayfed.config import ModelConfig, load_config
from rayfed.data.sources import ArrayDataset, DataError
from rayfed.method import build_method

from conftest import load_data
from rayfed.method import Upload
from conftest import compiled_update_gap, method_class
from rayfed.methods.pfedmma import BaseNovelOptions, MultiModalAdapter, base_novel_split
from rayfed.methods.pfedmma.adapter import attach
from rayfed.results.derived_metrics import across_datasets, harmonic_mean
from rayfed.tasks import Task
from rayfed.zoo.clip import image_processor, tiny_config
from rayfed.zoo.tokenizers import word_tokenizer

TASKS = [Task(0, "base", ("red circle", "blue square", "green_star")), Task(1, "novel", ("pink ring", "cyan bar"))]


def _pfedmma(**params):
    method_cls = method_class("pfedmma")
    return method_cls(method_cls.Params(**params))


@pytest.fixture(scope="module")
def vit_b16():
    """open_clip ViT-B-16 with pretrained=None (random weights, nothing downloaded) and pFedMMA's r=32, l=10."""
    method = _pfedmma(rank=32, first_layer=10)
    config = ModelConfig(backbone="open_clip:ViT-B-16", pretrained=None, lora=None)
    return method, method.build_model(None, config, TASKS, seed=0)


@pytest.fixture(scope="module")
def tiny_hf_clip(tmp_path_factory) -> str:
    """A tiny HF CLIPModel saved with save_pretrained (4 blocks per tower), loaded as ``hf:<folder>``."""
    folder = tmp_path_factory.mktemp("tiny_clip")
    tokenizer = word_tokenizer(append_eos=True, model_max_length=16)
    sizes = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                 projection_dim=16, image_size=16, patch_size=8, max_text_length=16)  # fmt: skip
    torch.manual_seed(0)
    transformers.CLIPModel(tiny_config(sizes, tokenizer)).save_pretrained(folder)
    transformers.CLIPProcessor(image_processor=image_processor(16), tokenizer=tokenizer).save_pretrained(folder)
    return f"hf:{folder}"


def _weights(params: dict[str, torch.Tensor], biases: bool) -> int:
    return sum(v.numel() for n, v in params.items() if biases or n.endswith(".weight"))


def test_vit_b16_adapter_counts_match_the_paper(vit_b16):
    """The paper's count (docs/pfedmma.md#parameter-counts): per block 2r(d_v + d_t) + r^2 = 82,944 weights; l=10 ->
    m=3 blocks."""
    method, model = vit_b16
    trainable = model.trainable_params()
    assert all(name.startswith("adapter.") for name in trainable)
    assert _weights(trainable, biases=False) == 248_832
    assert _weights(trainable, biases=True) == 252_960
    shared, personal = method.split(trainable)
    assert _weights(shared, biases=False) == 3_072 and _weights(shared, biases=True) == 3_168
    assert sorted(shared) == [f"adapter.shared.{j}.{p}" for j in (10, 11, 12) for p in ("bias", "weight")]
    assert all(v.shape in ((32, 32), (32,)) for v in shared.values())
    assert model.adapter.image_down["10"].in_features == 768 and model.adapter.text_down["10"].in_features == 512


def test_one_shared_projection_serves_both_towers_and_init_follows_the_spec(vit_b16):
    _, model = vit_b16
    adapter = model.adapter
    for j in (10, 11, 12):
        assert adapter.shared_projection("image", j) is adapter.shared_projection("text", j)
    assert adapter.blocks == (10, 11, 12)
    for name, param in adapter.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(param) == 0, name
        else:  # kaiming normal, fan_out: std sqrt(2 / fan_out); the up-projection is not zero
            assert abs(param.std().item() / math.sqrt(2 / param.shape[0]) - 1) < 0.1, name


def test_untied_variants_have_one_shared_projection_per_tower():
    adapter = MultiModalAdapter({"image": 12, "text": 8}, 4, [2, 3], 0.1, tied=False)
    assert adapter.shared_projection("image", 2) is not adapter.shared_projection("text", 2)
    names = {n.split(".")[0] for n, _ in adapter.named_parameters()}
    assert names == {"image_down", "image_shared", "image_up", "text_down", "text_shared", "text_up"}


@pytest.mark.parametrize(
    ("variant", "communicated"),
    [
        ("pfedmma", {"shared"}),
        ("all_global", {"image_down", "image_up", "text_down", "text_up", "shared"}),
        ("shared_personal", {"image_down", "image_up", "text_down", "text_up"}),
        ("vision_only", {"image_shared"}),
        ("text_only", {"text_shared"}),
        ("both", {"image_shared", "text_shared"}),
        ("local_only", set()),
    ],
)
def test_variants_communicate_what_the_spec_says(tiny_hf_clip, variant, communicated):
    method = _pfedmma(rank=4, first_layer=3, variant=variant)
    model = method.build_model(None, ModelConfig(backbone=tiny_hf_clip, lora=None), TASKS, seed=0)
    shared, _ = method.split(model.trainable_params())
    assert {name.split(".")[1] for name in shared} == communicated


def test_gradient_scale_multiplies_adapter_gradients_by_one_over_alpha_and_keeps_the_input_gradient():
    alpha = 0.005
    ln = torch.nn.LayerNorm(12)
    z0 = torch.randn(3, 5, 12)
    grads = {}
    for scaled in (True, False):
        torch.manual_seed(0)
        adapter = MultiModalAdapter({"image": 12, "text": 8}, 4, [1], alpha, grad_scale=scaled)
        z = z0.clone().requires_grad_(True)
        out = adapter.branch("image", 1, z, ln)
        (out * torch.arange(12.0)).sum().backward()
        grads[scaled] = (out.detach(), z.grad, {n: p.grad for n, p in adapter.named_parameters() if p.grad is not None})
    assert torch.equal(grads[True][0], grads[False][0])  # the forward pass is unchanged
    assert torch.allclose(grads[True][1], grads[False][1], rtol=1e-5, atol=1e-8)  # exact gradient into z
    for name, grad in grads[False][2].items():
        assert torch.allclose(grads[True][2][name], grad / alpha, rtol=1e-4, atol=1e-6), name
    assert set(grads[False][2]) == {"image_down.1.weight", "image_down.1.bias", "shared.1.weight", "shared.1.bias",
                                    "image_up.1.weight", "image_up.1.bias"}  # fmt: skip


def test_adapter_runs_in_parallel_with_the_block_and_reads_its_ln_1():
    import open_clip

    block = open_clip.transformer.ResidualAttentionBlock(16, 2)
    adapter = MultiModalAdapter({"image": 16, "text": 16}, 4, [1], alpha=0.5)
    z = torch.randn(2, 5, 16)
    with torch.no_grad():
        plain = block(z)
        attach(adapter, "image", [block], "ln_1")
        adapted = block(z)
        expected = plain + 0.5 * adapter.adapt("image", 1, block.ln_1(z))
    assert torch.allclose(adapted, expected, atol=1e-6)


def _toy_dataset(num_classes: int = 5, per_class: int = 8) -> ArrayDataset:
    labels = np.repeat(np.arange(num_classes), per_class).astype(np.int64)
    images = np.random.default_rng(0).random((len(labels), 16, 16, 3), dtype=np.float32)
    return ArrayDataset(images, labels, tuple(f"class_{c}" for c in range(num_classes)))


def test_base_novel_split_follows_the_label_space_rules():
    dataset = _toy_dataset()  # 5 classes: base = ids 0, 1, 2 (ceil(5/2)), novel = 3, 4
    cut = base_novel_split(dataset.labels, dataset.class_names, 2, BaseNovelOptions(shots=2), 0.5, seed=0)
    assert [(space.name, space.classes) for space in cut.label_spaces] == [("base", (0, 1, 2)), ("novel", (3, 4))]
    chunks = [set(dataset.labels[train]) for train, _ in cut.splits]
    assert [len(c) for c in chunks] == [2, 1]  # round(3 / 2) = 2 classes, the last client the remainder
    assert set.union(*chunks) == {0, 1, 2} and not set.intersection(*chunks)
    for (train, test), classes in zip(cut.splits, chunks):
        assert len(train) == 2 * len(classes)  # K shots per class
        assert set(dataset.labels[test]) == classes and not set(train) & set(test)
    base, novel = cut.shared_tests
    assert (base.name, base.space, novel.name, novel.space) == ("base", 0, "novel", 1)
    assert set(dataset.labels[base.indices]) == {0, 1, 2} and set(dataset.labels[novel.indices]) == {3, 4}
    own_tests = np.concatenate([test for _, test in cut.splits])
    assert set(own_tests) == set(base.indices)  # the clients' own tests tile the whole base test split


def test_the_base_novel_partitioner_makes_two_relabelled_tasks_with_shared_base_and_novel_tests():
    from rayfed.data.clients import build_federation

    federation = build_federation(load_config(_clip_run("tiny:clip", ["clip_zeroshot"])).data, seed=1)
    assert [(task.index, task.name, task.num_classes) for task in federation.tasks] == [(0, "base", 4), (1, "novel", 4)]
    (holding,) = federation.holdings
    base, novel = federation.shared
    assert (base.name, base.task, novel.name, novel.task) == ("base", 0, "novel", 1)
    assert set(holding.dataset.labels[novel.indices]) == {0, 1, 2, 3}  # novel classes relabelled 0..k-1
    assert set(holding.dataset.labels[base.indices]) == {0, 1, 2, 3}


def test_base_novel_rejects_more_clients_than_base_classes_allow():
    dataset = _toy_dataset()
    with pytest.raises(DataError, match="data.num_clients = 4"):
        base_novel_split(dataset.labels, dataset.class_names, 4, BaseNovelOptions(shots=2), 0.5, seed=0)


@pytest.mark.parametrize("options, field", [({"shot": 2}, "'shot'"), ({"shots": 0}, "options.shots = 0"),
                                            ({"base_excludes_local": "yes"}, "base_excludes_local = 'yes'")])
def test_base_novel_options_are_checked(options, field):
    from rayfed.data.partition import partition

    dataset = _toy_dataset()
    with pytest.raises(DataError, match=field):
        partition(dataset.labels, 2, "base_novel", seed=0, class_names=dataset.class_names, options=options)
    with pytest.raises(DataError, match="data.partition.alpha is not used"):
        partition(dataset.labels, 2, "base_novel", seed=0, class_names=dataset.class_names, alpha=0.5)


def _clip_run(backbone: str, methods: list) -> dict:
    return {
        "name": "clip",
        "seed": 1,
        "data": {"source": "synthetic", "synthetic": {"num_samples": 160, "num_classes": 8, "image_size": 16},
                 "num_clients": 2, "test_fraction": 0.5, "partition": {"name": "base_novel", "options": {"shots": 4}}},
        "model": {"backbone": backbone, "lora": None},
        "federation": {"rounds": 2, "clients_per_round": 1},
        "train": {"local_steps": 2, "batch_size": 4, "lr": 0.01, "optimizer": "sgd", "momentum": 0.9},
        "methods": methods,
        "placement": {"clients_per_actor": 2},
    }  # fmt: skip


def test_uploads_hold_only_the_shared_projections_and_evaluation_scores_both_label_spaces(tiny_hf_clip):
    from rayfed.actors.client import ClientActor, RoundUploads
    from rayfed.actors.driver import DriverActor

    config = load_config(_clip_run(tiny_hf_clip, [{"name": "pfedmma", "rank": 4, "first_layer": 3}])).to_dict()
    actor, driver = ClientActor(config, [0, 1]), DriverActor(config)
    initial = actor.start_method(0)
    driver.start_method(0, [""], initial, actor.task_tags())
    uploads = actor.train(0, [0, 1], driver.payloads([0, 1]))
    for upload in uploads:
        assert set(upload.tensors) == {"shared"}
        assert sorted(upload.tensors["shared"]) == sorted(initial)
        assert all(".shared." in name for name in upload.tensors["shared"])
        assert upload.nbytes == 2 * (4 * 4 + 4) * 4  # m (r^2 + r) float32 values, m = blocks 3..4
    personal = actor.states[0]["personal"]
    assert personal and all(".shared." not in name for name in personal)
    driver.aggregate(RoundUploads(uploads, 0, 0, {}))
    n0, n1 = (actor.data[c].num_train for c in (0, 1))
    name = sorted(initial)[0]
    expected = (n0 * uploads[0].tensors["shared"][name] + n1 * uploads[1].tensors["shared"][name]) / (n0 + n1)
    assert torch.allclose(driver.get_state()["global"][name], expected)
    metrics = actor.evaluate(1, driver.payloads([0, 1], False))
    for client_metrics in metrics.values():
        assert {"local_acc", "base_acc", "novel_acc", "hm"} <= set(client_metrics)
        parts = [client_metrics[k] for k in ("local_acc", "base_acc", "novel_acc")]
        assert client_metrics["hm"] == pytest.approx(harmonic_mean(parts))
    base_labels, novel_labels = (eval_set.columns["labels"] for eval_set in actor.eval_sets)
    assert len(base_labels) == 40 and len(novel_labels) == 40  # whole base / novel test splits
    assert int(novel_labels.max()) == 3  # 4 novel classes, 4-way


def test_local_accuracy_is_over_all_base_classes_and_novel_over_novel_ones(tiny_hf_clip):
    model = build_classifier(ModelConfig(backbone=tiny_hf_clip, lora=None), [t.class_names for t in TASKS])
    model.eval()
    images = torch.rand(2, 3, 16, 16)
    assert model(images).shape == (2, 3)
    model.select_task(1)
    assert model(images).shape == (2, 2)


def test_eval_text_features_follow_the_loaded_adapter_values(tiny_hf_clip):
    """Text class features are re-encoded after every load: no stale cache across clients or rounds."""
    method = _pfedmma(rank=4, first_layer=3)
    model = method.build_model(None, ModelConfig(backbone=tiny_hf_clip, lora=None), TASKS, seed=0)
    model.eval()
    images = torch.rand(2, 3, 16, 16)
    first = model.trainable_params()
    with torch.no_grad():
        before = model(images)
        text_before = model.class_features().clone()
        other = {n: v + 0.5 * torch.randn_like(v) for n, v in first.items() if n.startswith("adapter.text_")}
        model.load_trainable(other)
        assert not torch.allclose(model.class_features(), text_before)
        assert not torch.allclose(model(images), before)
        model.load_trainable(first)
        assert torch.allclose(model(images), before, atol=1e-6)


def test_promptfl_trains_and_shares_only_the_context(tiny_hf_clip):
    method_cls = method_class("promptfl")
    method = method_cls(method_cls.Params(n_ctx=4))
    model = method.build_model(None, ModelConfig(backbone=tiny_hf_clip, lora=None), TASKS, seed=0)
    trainable = model.trainable_params()
    assert list(trainable) == ["context"] and trainable["context"].shape == (4, 32)
    assert method.split(trainable)[0].keys() == {"context"}
    model.eval()
    images = torch.rand(2, 3, 16, 16)
    with torch.no_grad():
        before = model(images)
        model.load_trainable({"context": torch.randn(4, 32)})
        assert not torch.allclose(model(images), before)
    with pytest.raises(Exception, match="n_ctx"):
        method_cls(method_cls.Params(n_ctx=14)).build_model(None, ModelConfig(backbone=tiny_hf_clip, lora=None), TASKS, 0)


def test_round_zero_trains_every_client_and_zero_shot_trains_none():
    assert _pfedmma().participants(0, [3], 5) == [0, 1, 2, 3, 4]
    assert _pfedmma().participants(1, [3], 5) == [3]
    assert _pfedmma(first_round_all=False).participants(0, [3], 5) == [3]
    assert method_class("clip_zeroshot")().participants(0, [3], 5) == []


def test_mean_hm_is_the_hm_of_client_means_and_the_dataset_average_is_the_mean_of_hms():
    from rayfed.simulation import mean_std

    clients = {0: {"local_acc": 1.0, "base_acc": 0.2, "novel_acc": 0.5}, 1: {"local_acc": 0.5, "base_acc": 0.6, "novel_acc": 0.5}}
    means, _ = mean_std(clients)
    assert means["hm"] == pytest.approx(harmonic_mean([0.75, 0.4, 0.5]))
    datasets = {"a": {"local_acc": 0.9, "hm": 0.8}, "b": {"local_acc": 0.7, "hm": 0.4}}
    assert across_datasets(datasets) == pytest.approx({"local_acc": 0.8, "hm": 0.6})


def test_novel_evaluation_needs_a_text_classifier(tiny_hf_clip, tmp_path):
    from rayfed.errors import ConfigError
    from rayfed.simulation import Simulation

    run = _clip_run(tiny_hf_clip, ["fedavg"])
    run["model"]["lora"] = {"rank": 2}
    with pytest.raises(ConfigError, match=r"cannot score task\(s\) \[1\] that no client holds"):
        Simulation(run, out_dir=tmp_path / "run", progress=False).run()  # fails before Ray starts


def test_pfedmma_config_errors_name_the_field(tiny_hf_clip):
    from rayfed.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\(pfedmma\)\.variant = 'tied' is invalid: must be one of 'pfedmma', "
                                          r".*'local_only'\.$"):
        build_method(load_config(_clip_run(tiny_hf_clip, [{"name": "pfedmma", "variant": "tied"}])).methods[0], 0)
    with pytest.raises(ConfigError, match="first_layer = 9"):
        _pfedmma(first_layer=9).build_model(None, ModelConfig(backbone=tiny_hf_clip, lora=None), TASKS, 0)
    with pytest.raises(ConfigError, match="not a CLIP model"):
        build_classifier(ModelConfig(backbone="tiny:vit"), [("a", "b")])


def test_weighted_mean_over_participants_uses_sample_counts():
    method = _pfedmma()
    uploads = [Upload(0, 30, {"shared": {"w": torch.ones(2)}}, 0.0), Upload(2, 10, {"shared": {"w": torch.zeros(2)}}, 0.0)]
    server = method.aggregate({"global": {"w": torch.full((2,), 5.0)}}, uploads)
    assert torch.allclose(server["global"]["w"], torch.full((2,), 0.75))


@pytest.mark.parametrize("path", sorted(__import__("glob").glob("configs/pfedmma/*.yaml")))
def test_paper_and_offline_configs_validate_without_downloading(path):

    config = load_config(path)
    assert {entry.name for entry in config.methods} >= {"clip_zeroshot", "promptfl", "pfedmma"}
    if "offline" not in path:
        assert config.model.backbone == "open_clip:ViT-B-16" and config.model.pretrained == "openai"


def test_alpha_sweep_validates(tmp_path):
    from rayfed.tune.sweep import _Sweep

    sweep = _Sweep.build(load_config("configs/tune/pfedmma_alpha.yaml"), tmp_path, None)
    assert sweep.spec.metric == "pfedmma/hm" and sweep.max_rounds == 20


def test_labeldir_keeps_every_client_above_the_minimum_and_caps_sizes():
    from rayfed.data.partition import partition

    labels = np.repeat(np.arange(10), 60)
    clients = partition(labels, 12, "labeldir", seed=0, alpha=0.1, min_samples=10)
    assert sorted(np.concatenate(clients)) == list(range(600))
    assert min(len(c) for c in clients) >= 10
    assert partition(labels, 12, "labeldir", seed=0, alpha=0.1, min_samples=10)[3].tolist() == clients[3].tolist()
    skew = [np.bincount(labels[c], minlength=10).max() / len(c) for c in clients]
    assert np.mean(skew) > 0.4  # small beta: clients dominated by few classes


def test_domain_dirichlet_gives_each_domain_its_own_clients():
    from rayfed.data.partition import partition
    from rayfed.data.sources import DataError

    labels = np.tile(np.arange(5), 160)
    groups = np.repeat(np.arange(4), 200)
    clients = partition(labels, 8, "domain_dirichlet", seed=0, alpha=0.5, groups=groups, clients_per_domain=2, min_samples=10)
    assert [set(groups[c]) for c in clients] == [{0}, {0}, {1}, {1}, {2}, {2}, {3}, {3}]
    with pytest.raises(DataError, match="clients_per_domain = 3"):
        partition(labels, 8, "domain_dirichlet", seed=0, alpha=0.5, groups=groups, clients_per_domain=3)


def test_shapes_source_puts_a_colour_and_shape_covering_half_first():
    from rayfed.data.sources import load_source

    dataset = load_data("shapes", seed=0, synthetic={"num_samples": 256, "styles": ["sketch"]})
    base = dataset.class_names[:32]
    assert len(set(dataset.class_names)) == 64
    assert {name.split()[0] for name in base} == {name.split()[0] for name in dataset.class_names}
    assert {name.split()[1] for name in base} == {name.split()[1] for name in dataset.class_names}
    assert dataset.images.shape == (256, 32, 32, 3) and dataset.images.max() <= 1.0


def test_simulation_reports_base_novel_metrics_with_hm_of_the_means(tiny_hf_clip, tmp_path):
    import json

    from rayfed.simulation import Simulation

    run = _clip_run(tiny_hf_clip, ["clip_zeroshot", {"name": "pfedmma", "rank": 4, "first_layer": 3}])
    run["placement"]["executor"] = "local"  # what the run reports, not Ray: the same actors in this process
    Simulation(run, out_dir=tmp_path / "run", progress=False).run()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for label in ("clip_zeroshot", "pfedmma"):
        means = summary["methods"][label]["mean"]
        assert means["hm"] == pytest.approx(harmonic_mean([means["local_acc"], means["base_acc"], means["novel_acc"]]))
    assert summary["comm_bytes"]["clip_zeroshot"] == {"up": 0, "down": 0}
    # round 0: both clients upload m (r^2 + r) floats; round 1: the one sampled client
    assert summary["comm_bytes"]["pfedmma"]["up"] == 3 * 2 * (4 * 4 + 4) * 4


def test_packing_clients_into_actors_does_not_change_pfedmma_updates(tiny_hf_clip):
    from rayfed.actors.client import ClientActor

    config = load_config(_clip_run(tiny_hf_clip, [{"name": "pfedmma", "rank": 4, "first_layer": 3}])).to_dict()
    packed, alone = ClientActor(config, [0, 1]), ClientActor(config, [1])
    initial = packed.start_method(0)
    assert all(torch.equal(initial[n], v) for n, v in alone.start_method(0).items())  # one seed, one init
    [_, packed_upload] = packed.train(0, [0, 1], {0: initial, 1: initial})
    [alone_upload] = alone.train(0, [1], {1: initial})
    for name, value in packed_upload.tensors["shared"].items():
        assert torch.equal(value, alone_upload.tensors["shared"][name])
    assert packed.evaluate(1, {0: initial, 1: initial})[1] == alone.evaluate(1, {1: initial})[1]


def test_base_excludes_local_scores_base_accuracy_on_other_clients_classes_only(tiny_hf_clip):
    from rayfed.actors.client import ClientActor

    run = _clip_run(tiny_hf_clip, ["clip_zeroshot"])
    run["data"]["partition"]["options"]["base_excludes_local"] = True
    actor = ClientActor(load_config(run).to_dict(), [0])
    actor.start_method(0)
    base = actor.eval_sets[0]
    labels, own = base.columns["labels"], actor.data[0].parts[0].train["labels"]
    keep = ~torch.isin(labels, own.unique())
    assert base.exclude_own_classes and 0 < int(keep.sum()) < len(labels)
    actor.model.eval()
    with torch.no_grad():
        correct = actor.model(base.columns["pixel_values"]).argmax(1) == labels
    expected, over_all = correct[keep].float().mean().item(), correct.float().mean().item()
    assert expected != pytest.approx(over_all)  # the two rules give different numbers on this case
    assert actor.evaluate(0, {0: None})[0]["base_acc"] == pytest.approx(expected)



def _shapes_run() -> dict:
    """The shipped tiny CLIP on shape scenes, whose class names it reads (the synthetic source's prompts all tokenize
    alike, which leaves every logit equal and the update at round-off)."""
    run = _clip_run("tiny-pretrained:clip", [{"name": "pfedmma", "rank": 4, "first_layer": 1}])
    run["data"] = {"source": "shapes", "synthetic": {"num_samples": 1280, "styles": ["noisy"]}, "num_clients": 2,
                   "test_fraction": 0.5, "partition": {"name": "base_novel", "options": {"shots": 2}}}
    return run


def test_a_replayed_pfedmma_step_trains_as_the_eager_one(replayed_on_cpu):
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = _shapes_run()
    run["train"].update(optimizer="sgd", momentum=0.9)
    gap, moved = compiled_gap(run, [0, 1], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 1  # one step for both clients
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)  # none in a step
    assert moved > 1e-4 and gap < 1e-5


def test_a_compiled_pfedmma_update_uploads_the_eager_updates_numbers(monkeypatch):
    run = _shapes_run()
    # float32 sums in another order: round-off of about 1e-7 relative per operation; a wrong path, batch or lr
    # moves the update by its own size
    assert compiled_update_gap(run, [0], monkeypatch) < 1e-4
