"""Clients holding several tasks, task tags, several evaluation views per client (in-process, no Ray)."""

from __future__ import annotations

import pytest
import torch

from rayfed.actors.client import ClientActor
from rayfed.actors.driver import DriverActor
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import Method
from rayfed.simulation import kind_means, task_means
from rayfed.tasks import client_tasks
from rayfed.training import Step

from conftest import made_instances


def _task(name: str, clients: list[int], classes: int, offset: int) -> dict:
    return {"name": name, "source": "synthetic", "clients": clients, "partition": {"name": "iid"},
            "options": {"num_samples": 60 + offset, "num_classes": classes, "image_size": 8}}


def _run(methods: list) -> dict:
    return {"name": "multitask", "seed": 2,
            "data": {"tasks": [_task("a", [0, 1], 3, 0), _task("b", [1, 2], 4, 7)]},
            "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 2}},
            "federation": {"rounds": 2, "clients_per_round": 3},
            "train": {"local_steps": 2, "batch_size": 8, "lr": 0.01, "optimizer": "adam"},
            "methods": methods, "placement": {"clients_per_actor": 3, "cpus_per_actor": 0.5}}


def test_a_client_may_hold_several_tasks_and_gets_only_their_parameters():
    config = load_config(_run(["fedavg"]))
    assert client_tasks(config.data) == [(0,), (0, 1), (1,)]
    actor = ClientActor(config, [0, 1, 2])
    assert [part.task for part in actor.data[1].parts] == [0, 1]
    assert actor.data[1].num_train == sum(len(part.train["labels"]) for part in actor.data[1].parts)
    shared = actor.start_method(0)
    tags = actor.task_tags()
    assert tags["head.task_0.weight"] == {0} and tags["head.task_1.bias"] == {1}
    driver = DriverActor(config, actor.methods)
    driver.start_method(0, [""], shared, tags)
    payloads = driver.payloads([0, 1, 2])
    assert "head.task_1.weight" not in payloads[0] and "head.task_0.weight" not in payloads[2]
    assert {"head.task_0.weight", "head.task_1.weight"} <= set(payloads[1])
    uploads = actor.train(0, [0, 1, 2], payloads)
    assert set(uploads[1].tensors["shared"]) == set(payloads[1])
    metrics = actor.evaluate(1, payloads)
    assert set(metrics[0]) == {"local_acc", "local_loss"}
    assert set(metrics[1]) == {"a/local_acc", "a/local_loss", "b/local_acc", "b/local_loss"}
    tasks = actor.tasks
    by_task = task_means(metrics, client_tasks(config.data), tasks)
    assert by_task["a"]["local_acc"] == pytest.approx((metrics[0]["local_acc"] + metrics[1]["a/local_acc"]) / 2)
    assert by_task["b"]["local_acc"] == pytest.approx((metrics[2]["local_acc"] + metrics[1]["b/local_acc"]) / 2)
    avg = kind_means(metrics, client_tasks(config.data), tasks)["classification"]["local_acc"]
    pairs = [metrics[0]["local_acc"], metrics[1]["a/local_acc"], metrics[1]["b/local_acc"], metrics[2]["local_acc"]]
    assert avg == pytest.approx(sum(pairs) / 4)  # over (client, task) pairs: the papers' client-weighted Avg.


def test_the_loss_of_a_mixed_batch_weights_each_task_by_its_share():
    config = load_config(_run(["fedavg"]))
    actor = ClientActor(config, [1])
    shared = actor.start_method(0)
    client = actor._context(1, 0)
    client.model.load_trainable(shared)
    named = dict(client.model.named_parameters())
    parts = client.micro_batch(torch.arange(client.data.num_train))
    step = Step(client, parts, named, 0, 0, {})
    (task_a, batch_a), (task_b, batch_b) = parts
    losses = step.part_losses()
    n_a, n_b = len(batch_a["labels"]), len(batch_b["labels"])
    assert step.task_loss(losses).item() == pytest.approx((n_a * losses[0] + n_b * losses[1]).item() / (n_a + n_b))
    result = client.train(shared, steps=2)
    assert set(result.task_losses) == {0, 1}


def test_a_multi_task_clients_micro_batches_are_split_without_reading_the_datas_device():
    """The rows of each task are found on the host, where the batch order is drawn: on a GPU, finding them among
    indices on the device read each task's count back (a sync each). The meta device stands for one here: it holds
    no values, so any read from it fails."""
    config = load_config(_run(["fedavg"]))
    actor = ClientActor(config, [1])
    actor.start_method(0)
    client = actor._context(1, 0)
    parts = client.micro_batch(next(client.batch_order(1, "train", None)))
    client.data, client.device = client.data.to(torch.device("meta")), torch.device("meta")
    on_meta = client.micro_batch(next(client.batch_order(1, "train", None)))
    assert [task.index for task, _ in on_meta] == [task.index for task, _ in parts] == [0, 1]
    for (_, batch), (_, meta_batch) in zip(parts, on_meta):
        assert {k: v.shape for k, v in meta_batch.items()} == {k: v.shape for k, v in batch.items()}
        assert all(v.device.type == "meta" for v in meta_batch.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_multi_task_clients_parts_replay_as_graphs_and_train_like_the_eager_step(monkeypatch):
    """Each (task, rows) part of a micro-batch is one graph, replayed; the optimizer steps eagerly on the gradients
    they add up. Micro-batches of 3 rows from two tasks often hold one task alone: its head is then off the step's
    path and gets no gradient, so AdamW leaves it as the eager step does (a zero gradient would decay it and move
    it by its moments)."""
    from rayfed.training import graph_capture

    captured = made_instances(monkeypatch, graph_capture, "_GraphedPart")
    run = _run(["fedavg"])
    run["train"].update(batch_size=3, local_steps=8, grad_accum=2, optimizer="adamw", weight_decay=0.5,
                        grad_clip=0.5, autocast="off")
    results = []
    for graphs in (False, True):
        run["train"]["cuda_graphs"] = graphs
        actor = ClientActor(load_config(run), [1])
        start = actor.start_method(0)
        client = actor._context(1, 0)
        seen = [[task.index for task, _ in client.micro_batch(indices)]
                for indices in client.batch_order(16, "train", None)]
        results.append((client.train(start), start))
    assert [0] in seen or [1] in seen  # some micro-batch holds one task alone
    (reference, start), (replayed, _) = results
    assert 2 < len(captured) <= 2 * 4  # a graph per (task, rows); each task has 1 to 3 rows of 3
    assert float(replayed.loss) == pytest.approx(float(reference.loss), rel=1e-5)
    assert set(replayed.task_losses) == {0, 1}
    for name, value in reference.params.items():
        update = value - start[name].cuda()
        # float32: the sums of each part's gradient in another order, and cuBLAS's kernels under capture
        assert update.norm() > 0 and (replayed.params[name] - value).norm() < 1e-3 * update.norm(), name


def test_tasks_that_list_their_clients_must_cover_every_client_once_or_more():
    run = _run(["fedavg"])
    run["data"]["tasks"][1]["clients"] = [1, 3]
    with pytest.raises(ConfigError, match=r"none holds client 2"):
        load_config(run)
    run["data"]["tasks"][1].pop("clients")
    with pytest.raises(ConfigError, match=r"set clients in every task"):
        load_config(run)


class TwoViews(Method):
    """Reports the personal model and the received global one."""

    def eval_views(self, state, payload):
        return {"": {**state["personal"], **payload}, "global": dict(payload)}


def test_every_evaluation_view_is_reported_under_its_name():
    run = _run([TwoViews])
    config = load_config(run)
    actor = ClientActor(config, [0, 1, 2])
    shared = actor.start_method(0)
    metrics = actor.evaluate(0, {cid: shared for cid in (0, 1, 2)})
    assert set(metrics[0]) == {"local_acc", "local_loss", "local_acc@global", "local_loss@global"}
    assert metrics[0]["local_acc"] == metrics[0]["local_acc@global"]  # nothing personal yet: the same values
