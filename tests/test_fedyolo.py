"""The scale & modularity study and FedYolo (docs/fedyolo.md): module shapes and counts, frozen
parameters, zero-initialised modules, per-task views and aggregation, FedDyn, partitions, metrics."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfed.actors.client import ClientActor, RoundUploads
from rayfed.actors.driver import DriverActor
from rayfed.aggregation import presums
from rayfed.config import ModelConfig, load_config
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError
from rayfed.method import Upload, build_method
from conftest import compiled_update_gap, method_class
from rayfed.methods.feddyn import FedDyn, FedDynParams
from rayfed.methods.fedyolo import FedYoloParams
from rayfed.models import VIT_SIZES, build_backbone, build_client_model, build_task_model
from rayfed.models.peft.modules import (TASK_SELECTED_MODULES, AdaptedMLP, TaskHeads, representation_shift, select_task,
                             transformer_blocks)
from rayfed.param_names import task_of_name
from rayfed.simulation import rounds_to_target
from rayfed.tasks import Task, sample_round, task_view

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "fedyolo"

# Table 3 of the paper (trainable parameters with a 100-class head; ViT-L adapter printed without head).
TABLE3 = {
    "T": {"full": 5_543_716, "adapter": 58_564, "lora": 93_028, "vpt": 37_732, "head": 19_300},
    "S": {"full": 21_704_164, "adapter": 116_932, "lora": 185_956, "vpt": 75_364, "head": 38_500},
    "B": {"full": 85_875_556, "adapter": 233_668, "lora": 371_812, "vpt": 150_628, "head": 76_900},
    "L": {"full": 303_404_132, "adapter": 417_984, "lora": 888_932, "vpt": 299_108, "head": 102_500},
}
# Full / adapter uplink per round (docs/fedyolo.md#parameter-counts).
PAPER_RATIOS = {"T": 94.7, "S": 185.6, "B": 367.5, "L": 725.9}
STUDY_LORA = {"rank": 8, "alpha": 8, "targets": ["q_proj", "v_proj"]}


def _meta_counts(size: str) -> dict[str, dict]:
    """Trainable parameters per module: the total and per block, on the meta device (no weights)."""
    counts = {}
    with torch.device("meta"):
        backbone = build_backbone(ModelConfig(backbone=f"vit:{size}"), 0)
        for module in TABLE3[size]:
            config = ModelConfig(backbone=f"vit:{size}", module=module, lora=STUDY_LORA)
            model = build_client_model(backbone, config, 100, 0)
            trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
            blocks = VIT_SIZES[size]["num_hidden_layers"]
            per_block = [sum(v for n, v in trainable.items() if f"layers.{i}." in n) for i in range(blocks)]
            counts[module] = {"total": sum(trainable.values()), "per_block": per_block,
                              "head": sum(v for n, v in trainable.items() if n.startswith("head."))}
    return counts


@pytest.fixture(scope="module")
def vit_counts() -> dict[str, dict]:
    return {size: _meta_counts(size) for size in "TSBL"}


@pytest.mark.parametrize("size", "TSBL")
def test_module_counts_match_the_papers_table3_arithmetic(vit_counts, size):
    d, blocks = VIT_SIZES[size]["hidden_size"], VIT_SIZES[size]["num_hidden_layers"]
    counts, head = vit_counts[size], 100 * d + 100
    assert counts["head"]["total"] == counts["head"]["head"] == head == TABLE3[size]["head"]
    for module, per_block in (("adapter", 17 * d + 8), ("lora", 32 * d), ("vpt", 8 * d)):
        assert counts[module]["per_block"] == [per_block] * blocks, module
        assert counts[module]["total"] == blocks * per_block + head, module
    assert counts["full"]["total"] == TABLE3[size]["full"]
    for module in ("lora", "vpt"):
        assert counts[module]["total"] == TABLE3[size][module]
    adapter_without_head = counts["adapter"]["total"] - head
    assert TABLE3[size]["adapter"] in (counts["adapter"]["total"], adapter_without_head)
    assert (size == "L") == (TABLE3[size]["adapter"] == adapter_without_head)  # the paper's ViT-L row omits the head


def test_full_over_adapter_communication_ratios_are_the_papers(vit_counts):
    ratios = {}
    for size, counts in vit_counts.items():
        adapter = counts["adapter"]["total"] - (counts["head"]["total"] if size == "L" else 0)  # as Table 3 counts it
        ratios[size] = round(counts["full"]["total"] / adapter, 1)
    assert ratios == PAPER_RATIOS
    assert round(vit_counts["L"]["full"]["total"] / vit_counts["L"]["adapter"]["total"], 1) == 582.9  # head included


def _study_run(tiny_run: dict, methods: list, module: str = "adapter") -> dict:
    tiny_run["methods"] = methods
    tiny_run["model"] = {"backbone": "tiny:vit", "image_size": 8, "module": module, "adapter": {"dim": 4},
                         "vpt": {"prompts": 2}, "lora": {"rank": 2, "alpha": 4}}
    tiny_run["train"].update(optimizer="sgd", lr=0.1)
    return tiny_run


@pytest.mark.parametrize(("method", "module"), [
    ("fedavg", "adapter"), ("fedavg", "vpt"), ("fedavg", "lora"), ("fedavg", "head"), ("fedyolo", "adapter"),
    ("fedyolo", "vpt"),
])
def test_training_leaves_frozen_parameters_bitwise_unchanged_and_never_uploads_them(tiny_run, method, module):
    actor = ClientActor(load_config(_study_run(tiny_run, [method], module)).to_dict(), [0, 1])
    shared = actor.start_method(0)
    frozen = {n: p.clone() for n, p in actor.model.named_parameters() if not p.requires_grad}
    assert frozen and set(shared) == set(actor.model.trainable_names())
    uploads = actor.train(0, [0, 1], {0: shared, 1: shared})
    after = dict(actor.model.named_parameters())
    assert all(torch.equal(after[n], value) for n, value in frozen.items())
    for upload in uploads:
        sent = upload.tensors["shared"]
        assert set(sent).isdisjoint(frozen) and any(not torch.equal(sent[n], shared[n]) for n in sent)
        assert upload.nbytes == 4 * upload.nparams  # fp32: bits = 32 * params


def test_full_fine_tuning_trains_and_sends_every_parameter(tiny_run):
    actor = ClientActor(load_config(_study_run(tiny_run, ["fedavg"], "full")).to_dict(), [0])
    shared = actor.start_method(0)
    assert set(shared) == {n for n, _ in actor.model.named_parameters()}


@pytest.mark.parametrize("module", ["adapter", "lora"])
def test_zero_initialised_modules_leave_the_logits_of_backbone_plus_head(module):
    config = ModelConfig(backbone="tiny:vit", image_size=8, module=module, lora=STUDY_LORA)
    backbone = build_backbone(config, 0)
    images = torch.rand(5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with_module = build_client_model(backbone, config, 4, 7)
    plain = build_client_model(backbone, config.model_copy(update={"module": "head"}), 4, 7)
    assert torch.equal(with_module.head.weight, plain.head.weight)
    with torch.no_grad():
        assert torch.equal(with_module(images), plain(images))


def test_vpt_prompts_change_the_features_and_use_the_vpt_init():
    config = ModelConfig(backbone="tiny:vit", image_size=8, module="vpt")
    backbone = build_backbone(config, 0)
    model = build_client_model(backbone, config, 4, 0)
    prompts = [p for n, p in model.named_parameters() if "prompts" in n]
    d, patch = backbone.feature_dim, 4
    assert len(prompts) == 2 and all(p.shape == (8, d) for p in prompts)
    bound = (6 / (3 * patch * patch + d)) ** 0.5
    assert all(p.abs().max() <= bound for p in prompts)
    plain = build_client_model(backbone, config.model_copy(update={"module": "head"}), 4, 0)
    images = torch.rand(2, 3, 8, 8)
    with torch.no_grad():
        assert not torch.allclose(model.features(images), plain.features(images))


def test_an_unset_module_keeps_todays_meaning():
    assert ModelConfig().module == "lora"
    assert ModelConfig(lora=None).module == "head"
    with pytest.raises(ConfigError, match=r"methods\[1\]\.model\.backbone cannot be set per method"):
        load_config({"methods": ["fedavg", {"name": "fedavg", "label": "x", "model": {"backbone": "vit:T"}}]})
    with pytest.raises(ConfigError, match=r"model.module = 'lora' needs model.lora"):
        load_config({"model": {"module": "lora", "lora": None}})


# Multi-task ---------------------------------------------------------------------------------
def _task(name: str, classes: int, seed_offset: int, clients: int = 3, per_round: int = 2) -> dict:
    return {"name": name, "source": "synthetic", "num_clients": clients, "clients_per_round": per_round,
            "synthetic": {"num_samples": 96 + seed_offset, "num_classes": classes, "image_size": 8},
            "partition": {"name": "iid"}}


def _multitask_run(tiny_run: dict, tasks: list[dict], methods: list) -> dict:
    run = _study_run(tiny_run, methods, "adapter")
    run["data"] = {"tasks": tasks}
    run["federation"]["clients_per_round"] = sum(t["clients_per_round"] for t in tasks)
    run["train"]["local_steps"] = 2
    return run


def _trajectory(run: dict, rounds: int = 3) -> dict[str, torch.Tensor]:
    """Drive the actors directly for a few rounds (no Ray); return the server's parameters."""
    config = load_config(run)
    actor = ClientActor(config.to_dict(), list(range(config.data.num_clients)))
    driver = DriverActor(config.to_dict())
    driver.start_method(0, [""], actor.start_method(0), actor.task_tags())
    for round_idx in range(rounds):
        sampled = sample_round(config, round_idx)
        driver.aggregate(actor.train_round(round_idx, sampled, driver.payloads(sampled), {cid: 1.0 for cid in sampled}))
    return driver.get_state()["global"]


def test_fedyolo_task0_trajectory_is_bitwise_identical_with_other_tasks_present(tiny_run):
    cifar_like = _task("a", 4, 0)
    other = _task("b", 3, 7, clients=4, per_round=3)
    alone = _trajectory(_multitask_run(copy.deepcopy(tiny_run), [cifar_like], ["fedyolo"]))
    together = _trajectory(_multitask_run(copy.deepcopy(tiny_run), [cifar_like, other], ["fedyolo"]))
    assert set(alone) == {n for n in together if task_of_name(n) == 0}
    assert all(torch.equal(alone[n], together[n]) for n in alone)
    # FedAvg with one shared adapter: task 1's clients move task 0's modules.
    fedavg_alone = _trajectory(_multitask_run(copy.deepcopy(tiny_run), [cifar_like], ["fedavg"]))
    fedavg_together = _trajectory(_multitask_run(copy.deepcopy(tiny_run), [cifar_like, other], ["fedavg"]))
    adapters = [n for n in fedavg_alone if "adapters.shared" in n]
    assert adapters and any(not torch.equal(fedavg_alone[n], fedavg_together[n]) for n in adapters)


def test_private_uploads_send_every_tasks_slots_and_give_the_same_parameters(tiny_run):
    """FedYolo's privacy variant: zeros but one's own task, plus per-task counts; the aggregate is unchanged."""
    tasks = [_task("a", 4, 0), _task("b", 3, 7)]
    private = {"name": "fedyolo", "sharing": "half", "private_uploads": True}
    default = _trajectory(_multitask_run(copy.deepcopy(tiny_run), tasks, [{"name": "fedyolo", "sharing": "half"}]))
    assert all(torch.equal(default[n], value) for n, value in _trajectory(_multitask_run(copy.deepcopy(tiny_run), tasks, [private])).items())
    run = _multitask_run(copy.deepcopy(tiny_run), tasks, [private])
    actor = ClientActor(load_config(run).to_dict(), [0, 3])
    assert not presums(method_class("fedyolo")(FedYoloParams(private_uploads=True)).aggregation)
    assert presums(method_class("fedyolo")(FedYoloParams()).aggregation)  # the default still pre-sums on actors
    everything = actor.start_method(0)
    sent = actor.train(0, [0, 3], {0: task_view(everything, 0), 3: task_view(everything, 1)})
    for upload, own in zip(sent, (0, 1)):
        assert set(upload.tensors["shared"]) == set(everything)
        others = [v for n, v in upload.tensors["shared"].items() if task_of_name(n) not in (None, own)]
        assert others and all(not v.any() for v in others)
        assert upload.tensors["task_counts"]["counts"].tolist() == [upload.num_samples if k == own else 0 for k in (0, 1)]
        assert upload.nparams == sum(v.numel() for v in everything.values()) + 2


@pytest.mark.parametrize(("sharing", "dedicated_blocks"), [("none", {0, 1}), ("half", {1}), ("all", set())])
def test_fedyolo_clients_hold_only_their_tasks_view(tiny_run, sharing, dedicated_blocks):
    run = _multitask_run(tiny_run, [_task("a", 4, 0), _task("b", 3, 7)], [{"name": "fedyolo", "sharing": sharing}])
    actor = ClientActor(load_config(run).to_dict(), [0, 3])
    everything = actor.start_method(0)
    assert {n for n in everything if "heads" in n or n.startswith("head.")} == {
        "head.task_0.weight", "head.task_0.bias", "head.task_1.weight", "head.task_1.bias"}
    dedicated = {int(n.split("layers.")[1].split(".")[0]) for n in everything if "adapters.task_1" in n}
    assert dedicated == dedicated_blocks
    driver = DriverActor(load_config(run).to_dict())
    driver.start_method(0, [""], everything, actor.task_tags())
    payloads = driver.payloads([0, 3])
    assert all(task_of_name(n) in (None, 0) for n in payloads[0])
    assert all(task_of_name(n) in (None, 1) for n in payloads[3])
    uploads = actor.train(0, [0, 3], payloads)
    assert set(uploads[0].tensors["shared"]) == set(payloads[0])
    assert driver.aggregate(RoundUploads(uploads, 0, 0, {}))["down_params"] == sum(
        v.numel() for p in payloads.values() for v in p.values())


def test_a_task_without_sampled_clients_keeps_its_modules_and_shared_modules_average_over_all(tiny_run):
    run = _multitask_run(tiny_run, [_task("a", 4, 0), _task("b", 3, 7)], [{"name": "fedyolo", "sharing": "half"}])
    actor = ClientActor(load_config(run).to_dict(), [0, 1])
    driver = DriverActor(load_config(run).to_dict())
    initial = actor.start_method(0)
    driver.start_method(0, [""], initial, actor.task_tags())
    uploads = actor.train(0, [0, 1], driver.payloads([0, 1]))
    driver.aggregate(RoundUploads(uploads, 0, 0, {}))
    after = driver.get_state()["global"]
    for name, value in initial.items():
        task = task_of_name(name)
        if task == 1:
            assert torch.equal(after[name], value), name
        else:
            weights = [u.num_samples for u in uploads]
            expected = sum(w * u.tensors["shared"][name] for w, u in zip(weights, uploads)) / sum(weights)
            assert torch.allclose(after[name], expected, atol=1e-6), name


def test_per_task_modules_switch_with_the_selected_task():
    config = ModelConfig(backbone="tiny:vit", image_size=8, module="adapter")
    backbone = build_backbone(config, 0)
    tasks = [Task(0, "a", ("x", "y")), Task(1, "b", ("x", "y", "z"))]
    model = build_task_model(backbone, config, tasks, 0, lambda block: True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "task_1" in name and "up" in name:
                param.normal_()
    images = torch.rand(2, 3, 8, 8)
    select_task(model, 0)
    assert model(images).shape == (2, 2)
    features0 = model.features(images)
    select_task(model, 1)
    assert model(images).shape == (2, 3)
    assert not torch.allclose(features0, model.features(images))
    single = build_task_model(backbone, config, tasks[:1], 0, lambda block: True)
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in single.named_parameters())


def test_task_switches_walk_the_model_once_and_again_after_a_module_is_added(monkeypatch):
    config = ModelConfig(backbone="tiny:vit", image_size=8, module="adapter")
    tasks = [Task(0, "a", ("x", "y")), Task(1, "b", ("x", "y", "z"))]
    model = build_task_model(build_backbone(config, 0), config, tasks, 0, lambda block: True)
    walks = []
    walk = type(model).modules
    monkeypatch.setattr(type(model), "modules", lambda self: walks.append(1) or walk(self))
    for task in (0, 1, 0, 1):
        select_task(model, task)
    assert len(walks) == 1
    sites = [m for m in walk(model) if isinstance(m, (*TASK_SELECTED_MODULES, TaskHeads))]
    assert sites and all(m.active_task == 1 for m in sites)
    block = transformer_blocks(model.encoder)[0]
    block.mlp = AdaptedMLP(block.mlp.mlp, block.mlp.adapters)  # a new site, registered as an attribute
    select_task(model, 0)
    assert len(walks) == 2 and block.mlp.active_task == 0
    select_task(model, 1)
    assert len(walks) == 2 and block.mlp.active_task == 1


def test_stratified_sampling_draws_every_task_from_its_own_stream(tiny_run):
    one = load_config(_multitask_run(copy.deepcopy(tiny_run), [_task("a", 4, 0, 5, 2)], ["fedyolo"]))
    two = load_config(_multitask_run(copy.deepcopy(tiny_run), [_task("a", 4, 0, 5, 2), _task("b", 3, 7, 6, 3)], ["fedyolo"]))
    for round_idx in range(5):
        alone, both = sample_round(one, round_idx), sample_round(two, round_idx)
        assert [c for c in both if c < 5] == alone and len([c for c in both if c >= 5]) == 3


def test_task_config_errors_name_the_field(tiny_run):
    run = _multitask_run(tiny_run, [_task("a", 4, 0), _task("b", 3, 7)], ["fedyolo"])
    run["federation"]["clients_per_round"] = 3
    with pytest.raises(ConfigError, match=r"federation.clients_per_round = 3 differs from the sum 4"):
        load_config(run)
    with pytest.raises(ConfigError, match=r"data.source is set next to data.tasks"):
        load_config({"data": {"source": "fashion_mnist", "tasks": [_task("a", 4, 0)]},
                     "federation": {"clients_per_round": 2}})
    with pytest.raises(ConfigError, match=r"^methods\[0\] \(fedyolo\)\.sharing = 'some' is invalid: must be one of "
                                          r"'none', 'half', 'all'\.$"):
        build_method(load_config({"methods": [{"name": "fedyolo", "sharing": "some"}]}).methods[0], 0)


# FedDyn -------------------------------------------------------------------------------------
def test_feddyn_server_follows_the_papers_update():
    alpha, current = 0.1, {"w": torch.tensor([1.0, 2.0])}
    method = FedDyn(FedDynParams(alpha=alpha))
    method.num_clients = 4
    server = method.init_server(current)
    uploads = [Upload(cid, 10 + cid, {"shared": {"w": value}}, 0.0)
               for cid, value in ((2, torch.tensor([2.0, 2.0])), (0, torch.tensor([0.0, 4.0])))]
    after = method.aggregate(server, uploads)
    h = -(alpha / 4) * (torch.tensor([2.0, 2.0]) + torch.tensor([0.0, 4.0]) - 2 * current["w"])
    assert torch.allclose(after["h"]["w"], h)
    assert torch.allclose(after["global"]["w"], torch.tensor([1.0, 3.0]) - h / alpha)


def test_feddyn_client_gradient_state_moves_against_its_drift(tiny_run):
    actor = ClientActor(load_config(_study_run(tiny_run, [{"name": "feddyn", "alpha": 0.5}])).to_dict(), [0])
    start = actor.start_method(0)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in actor.states[0]["dyn_grad"].values())
    [upload] = actor.train(0, [0], {0: start})
    for name, grad in actor.states[0]["dyn_grad"].items():
        assert torch.allclose(grad, -0.5 * (upload.tensors["shared"][name] - start[name]))


# Data and metrics ---------------------------------------------------------------------------
@pytest.mark.parametrize("classes_per_client", [20, 5])
def test_every_client_of_a_classes_per_client_partition_has_c_classes_and_100_training_samples(classes_per_client):
    data = load_config({"data": {
        "source": "synthetic", "synthetic": {"num_samples": 8000, "num_classes": 40, "image_size": 4},
        "num_clients": 20, "partition": {"name": "shards", "classes_per_client": classes_per_client,
                                         "samples_per_client": 100, "test_samples_per_client": 40}},
        "federation": {"clients_per_round": 5}}).data
    (holding,) = build_federation(data, seed=1).holdings
    labels = holding.dataset.labels
    used = np.concatenate([np.concatenate(split) for split in holding.splits])
    assert len(used) == len(np.unique(used))  # no sample is reused
    for train, test in holding.splits:
        assert len(train) == 100 and len(test) == 40
        assert len(np.unique(labels[train])) == classes_per_client
        assert set(labels[test]) == set(labels[train])


def test_a_global_test_set_holds_samples_no_client_holds_and_gives_global_acc(tiny_run):
    """The study's global accuracy (docs/fedyolo.md#data): the same set for every client, outside every client's
    data."""
    run = copy.deepcopy(tiny_run)
    run["data"].update(partition={"name": "shards", "classes_per_client": 2, "samples_per_client": 10,
                                  "test_samples_per_client": 4, "global_test_samples": 30})  # fmt: skip
    config = load_config(run)
    federation = build_federation(config.data, config.seed)
    (shared,) = federation.shared
    name, indices, task, exclude_own = shared.name, shared.indices, shared.task, shared.exclude_own_classes
    held = np.concatenate([np.concatenate(split) for split in shared.holding.splits])
    assert (name, task, exclude_own, len(indices), len(np.unique(indices))) == ("global", 0, False, 30, 30)
    assert not set(indices) & set(held)
    assert len(np.unique(shared.holding.dataset.labels[indices])) > 2  # more classes than any one client holds
    actor = ClientActor(config.to_dict(), [0, 1])
    shared = actor.start_method(0)
    metrics = actor.evaluate(0, {0: shared, 1: shared})
    model_preds = actor.model(actor.eval_sets[0].columns["pixel_values"].to(actor.device)).argmax(-1).cpu()
    expected = float((model_preds == actor.eval_sets[0].columns["labels"].cpu()).float().mean())
    assert metrics[0]["global_acc"] == metrics[1]["global_acc"] == pytest.approx(expected)
    run["data"]["partition"]["global_test_samples"] = 10**6
    with pytest.raises(ConfigError, match=r"data\.partition\.global_test_samples = 1000000 is more than the \d+ samples"):
        build_federation(load_config(run).data, config.seed)


def test_rounds_to_target_takes_the_first_round_reaching_it():
    events = [{"event": "eval", "method": m, "round": r, "local_acc": a}
              for m, r, a in (("a", 1, 0.5), ("a", 2, 0.9), ("b", 1, 0.7), ("b", 2, 0.8), ("b", 3, 1.0))]
    assert rounds_to_target(events, 0.8) == (0.8, {"a": 2, "b": 2})
    target, rounds = rounds_to_target(events, None)
    assert target == pytest.approx(0.95) and rounds == {"a": None, "b": 3}
    events.append({"event": "eval", "method": "a", "round": 2, "final": True, "local_acc": 1.0})
    assert rounds_to_target(events, 0.95, post_trained={"a"}) == (0.95, {"a": None, "b": 3})


def test_representation_shift_is_zero_for_head_tuning_and_positive_for_adapters():
    config = ModelConfig(backbone="tiny:vit", image_size=8, module="adapter")
    backbone = build_backbone(config, 0)
    model = build_client_model(backbone, config, 4, 0)
    initial = model.trainable_params()
    noise = torch.Generator().manual_seed(0)
    moved = {n: v + (torch.randn(v.shape, generator=noise) if ".up." in n else 0.0) for n, v in initial.items()}
    head_moved = {n: v + (0.5 if n.startswith("head.") else 0.0) for n, v in initial.items()}
    images = torch.rand(6, 3, 8, 8)
    assert representation_shift(model, initial, head_moved, images, 4) == pytest.approx(0.0, abs=1e-6)
    assert representation_shift(model, initial, moved, images, 4) > 1e-3


def test_the_paper_configs_validate_without_downloading():
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert len(paths) >= 10
    for path in paths:
        config = load_config(path)
        assert config.methods


def test_warmup_cosine_schedule_rises_linearly_then_decays_to_zero():
    from rayfed.config import TrainConfig
    from rayfed.training import scheduled_lr

    config = TrainConfig(schedule="warmup_cosine", warmup_steps=10, decay_steps=110)
    assert scheduled_lr(config, 0.03, 0, 0) == pytest.approx(0.003)
    assert scheduled_lr(config, 0.03, 0, 9) == pytest.approx(0.03)
    assert scheduled_lr(config, 0.03, 5, 60) == pytest.approx(0.015)
    assert scheduled_lr(config, 0.03, 9, 110) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ConfigError, match="needs train.decay_steps"):
        load_config({"train": {"schedule": "warmup_cosine"}})


def test_a_multitask_fedyolo_run_reports_per_task_means_and_parameter_counts(tiny_run, tmp_path):
    from rayfed.simulation import Simulation

    run = _multitask_run(tiny_run, [_task("a", 4, 0), _task("b", 3, 7)],
                         ["fedyolo", {"name": "fedavg", "label": "fedavg-full", "model": {"module": "full"}}])
    run["federation"].update(rounds=2, eval_every=1, representation_shift=True)
    run["placement"]["executor"] = "local"
    summary = Simulation(run, out_dir=tmp_path, progress=False).run()
    yolo, full = summary["methods"]["fedyolo"], summary["methods"]["fedavg-full"]
    assert set(yolo["tasks"]) == {"a", "b"}
    assert yolo["mean"]["local_acc"] == pytest.approx((3 * yolo["tasks"]["a"]["local_acc"] + 3 * yolo["tasks"]["b"]["local_acc"]) / 6)
    assert 0 < summary["comm_params"]["fedyolo"]["up"] * 10 < summary["comm_params"]["fedavg-full"]["up"]
    assert full["mean"]["rep_shift"] > 0 and yolo["mean"]["rep_shift"] > 0
    assert set(summary["rounds_to_target"]) == {"fedyolo", "fedavg-full"}


def test_natural_partition_keeps_only_groups_within_the_size_filter():
    data = load_config({"data": {
        "source": "synthetic", "synthetic": {"num_samples": 100, "num_classes": 2, "image_size": 4, "num_writers": 30},
        "num_clients": 20, "test_fraction": 0.5,
        "partition": {"name": "natural", "column": "writer", "max_group_size": 3}},
        "federation": {"clients_per_round": 2}}).data
    (holding,) = build_federation(data, seed=0).holdings
    assert len(holding.dataset.labels) == 60  # the 20 writers of 3 samples; the 10 of 4 are dropped
    assert all(len(train) + len(test) == 3 for train, test in holding.splits)
    with pytest.raises(ConfigError, match="more than the 20 groups"):
        build_federation(data.model_copy(update={"num_clients": 21}), seed=0)


def test_fedprox_with_mu_zero_is_fedavg(tiny_run):
    actor = ClientActor(load_config(_study_run(tiny_run, ["fedavg", {"name": "fedprox", "mu": 0.0}])).to_dict(), [0])
    uploads = []
    for index in (0, 1):
        start = actor.start_method(index)
        uploads.append(actor.train(0, [0], {0: start})[0].tensors["shared"])
    assert all(torch.equal(uploads[0][n], uploads[1][n]) for n in uploads[0])


def test_a_replayed_fedyolo_step_trains_as_the_eager_one(tiny_run, replayed_on_cpu):
    from rayfed.benchmarks.fast_steps_check import compiled_gap

    run = _study_run(tiny_run, ["fedyolo"])
    run["train"].update(momentum=0.9, grad_clip=1.0)
    gap, moved = compiled_gap(run, [0, 1], mode="cuda_graphs")
    assert len(replayed_on_cpu) == 1
    assert all(reads == 0 for step in replayed_on_cpu for reads in step.host_reads)  # none in a step
    assert moved > 1e-4 and gap < 1e-5


def test_a_compiled_fedyolo_update_uploads_the_eager_updates_numbers(tiny_run, monkeypatch):
    # float32 sums in another order: round-off of about 1e-7 relative per operation; a wrong path, batch or lr
    # moves the update by its own size
    assert compiled_update_gap(_study_run(tiny_run, ["fedyolo"]), [0], monkeypatch) < 1e-4
