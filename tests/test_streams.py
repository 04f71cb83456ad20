"""Clients whose data arrives over rounds: arrival, training pools, episodic memory, seen-so-far evaluation,
A_last / A_AUC."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from rayfed.training import client_context
from rayfed.actors.client import ClientActor
from rayfed.config import StreamConfig, load_config
from rayfed.errors import ConfigError
from rayfed.simulation import Simulation, stream_summary
from rayfed.data.streams import Window, arrival_rounds, task_windows, training_pool

ROOT = Path(__file__).resolve().parents[1]


def _images(name: str, clients: list[int], offset: int) -> dict:
    return {"name": name, "source": "synthetic", "clients": clients, "partition": {"name": "iid"},
            "options": {"num_samples": 80 + offset, "num_classes": 3, "image_size": 8}}


STREAM_RUN = {
    "name": "stream", "seed": 6,
    "data": {"tasks": [_images("a", [0, 1], 0), _images("b", [0, 1], 5), _images("c", [2, 3], 9)],
             "stream": {"mode": "dynamic", "rounds_per_task": 2}},
    "model": {"backbone": "tiny:vit", "image_size": 8, "lora": {"rank": 2}},
    "federation": {"rounds": 4, "clients_per_round": 4},
    "train": {"local_steps": 3, "batch_size": 4, "lr": 0.01, "optimizer": "adam"},
    "methods": ["fedavg"], "placement": {"clients_per_actor": 2, "cpus_per_actor": 0.5},
}


def test_task_windows_follow_the_mode():
    dynamic = StreamConfig(mode="dynamic", rounds_per_task=5)
    assert task_windows(dynamic, 0, 3, 3) == [Window(0, 5), Window(5, 5), Window(10, 5)]
    assert task_windows(StreamConfig(mode="static"), 0, 3, 2) == [Window(0, 1), Window(0, 1)]
    patterns = ((5, 5, 5, 5), (3, 7, 3, 7), (7, 3, 7, 3))
    drawn = {tuple(w.length for w in task_windows(StreamConfig(mode="asynchronous"), 0, c, 4)) for c in range(30)}
    assert drawn == set(patterns)  # each client draws one pattern; over 30 clients all three appear
    assert task_windows(StreamConfig(mode="asynchronous"), 0, 7, 4) == task_windows(StreamConfig(mode="asynchronous"), 0, 7, 4)


def test_a_tasks_samples_arrive_in_equal_chunks_over_its_window():
    arrival = arrival_rounds(StreamConfig(), seed=1, client_id=0, task=2, window=Window(5, 5), num_samples=23)
    assert sorted(set(arrival.tolist())) == [5, 6, 7, 8, 9] and sorted(np.bincount(arrival)[5:]) == [4, 4, 5, 5, 5]
    at_once = arrival_rounds(StreamConfig(gradual=False), seed=1, client_id=0, task=2, window=Window(5, 5), num_samples=23)
    assert set(at_once.tolist()) == {5}


def test_a_client_never_trains_on_a_sample_before_it_arrives(monkeypatch):
    config = load_config(STREAM_RUN)
    actor = ClientActor(config, [0, 1])
    shared = actor.start_method(0)
    drawn: list[torch.Tensor] = []
    original = client_context.seeded_batches

    def recording(*args, **kwargs):
        for indices in original(*args, **kwargs):
            drawn.append(indices.clone())
            yield indices

    monkeypatch.setattr(client_context, "seeded_batches", recording)
    arrival = actor.data[0].arrival
    assert arrival is not None and len(arrival) == actor.data[0].num_train
    for round_idx in range(4):
        drawn.clear()
        actor.train(round_idx, [0], {0: shared})
        rows = torch.cat(drawn).numpy()
        assert (arrival[rows] <= round_idx).all(), round_idx
        assert set(arrival[rows].tolist()) >= {round_idx}  # what arrives this round is trained on at once
    # task b's samples arrive from round 2: never drawn in rounds 0, 1
    first_b = actor.data[0].parts[1].first_round
    assert first_b == 2 and (arrival[actor.data[0].task_of_row == 1] >= 2).all()


def test_an_episodic_memory_keeps_a_fixed_size_sample_of_the_past():
    arrival = np.repeat(np.arange(6), 10)  # 10 samples arrive per round
    task_of_row = np.repeat([0, 1], 30)
    reservoir = StreamConfig(memory=8)
    pools = [training_pool(reservoir, 0, 1, r, arrival, task_of_row) for r in range(6)]
    for r, pool in enumerate(pools):
        new = set(np.flatnonzero(arrival == r))
        assert new <= set(pool) and (arrival[pool] <= r).all()
        assert len(set(pool) - new) == min(8, 10 * r)  # the memory: 8 earlier samples once 8 have passed
    assert np.array_equal(pools[4], training_pool(reservoir, 0, 1, 4, arrival, task_of_row))  # seeded
    quota = training_pool(StreamConfig(memory=8, memory_policy="per_task"), 0, 1, 5, arrival, task_of_row)
    remembered = [row for row in quota if arrival[row] < 5]
    assert np.bincount(task_of_row[remembered]).tolist() == [4, 4]  # an equal quota per seen task
    unbounded = training_pool(StreamConfig(), 0, 1, 3, arrival, task_of_row)
    assert set(unbounded) == set(np.flatnonzero(arrival <= 3))


def test_evaluation_covers_the_tasks_seen_so_far_and_the_other_clients_tasks():
    config = load_config(STREAM_RUN)
    actor = ClientActor(config, [0, 2])
    shared = actor.start_method(0)
    payloads = {0: shared, 2: shared}
    early, late = actor.evaluate(1, payloads), actor.evaluate(3, payloads)
    assert {k for k in early[0] if k.startswith("a/")} and not any(k.startswith("b/") for k in early[0])
    assert {k for k in late[0] if k.startswith("b/")}  # task b arrived at round 2: seen after 3 rounds
    assert {"self_acc", "others_acc"} <= set(early[0]) and {"self_acc", "others_acc"} <= set(late[2])
    assert late[0]["self_acc"] == pytest.approx((late[0]["a/local_acc"] + late[0]["b/local_acc"]) / 2)
    assert late[2]["self_acc"] == late[2]["local_acc"]  # client 2 holds task c alone
    # client 2's "others" are tasks a and b, each from the round its holders' samples start arriving
    assert [(other.task, other.first_round) for other in actor.others[2]] == [(0, 0), (1, 2)]
    assert all(not other.missing["head.task_" + str(other.task) + ".weight"].isnan().any() for other in actor.others[2])


def test_others_by_task_reports_each_other_task_whose_mean_is_others():
    config = copy.deepcopy(STREAM_RUN)
    config["data"]["stream"]["others_by_task"] = True
    actor = ClientActor(load_config(config), [0, 2])
    shared = actor.start_method(0)
    early, late = actor.evaluate(1, {0: shared, 2: shared}), actor.evaluate(3, {0: shared, 2: shared})
    # Client 2 is scored on task a from round 0 and on task b once it has arrived (round 2); client 0 on c.
    assert sorted(k for k in early[2] if k.startswith("others/")) == ["others/a_acc"]
    assert sorted(k for k in late[2] if k.startswith("others/")) == ["others/a_acc", "others/b_acc"]
    assert late[2]["others_acc"] == pytest.approx((late[2]["others/a_acc"] + late[2]["others/b_acc"]) / 2)
    assert sorted(k for k in late[0] if k.startswith("others/")) == ["others/c_acc"]
    plain = ClientActor(load_config(STREAM_RUN), [2])
    assert not any(k.startswith("others/") for k in plain.evaluate(3, {2: plain.start_method(0)})[2])


def test_a_last_and_a_auc_are_the_last_value_and_the_mean_over_evaluations():
    events = [{"event": "eval", "method": "m", "round": r, "self_acc": a, "others_acc": b}
              for r, a, b in ((0, 0.0, 0.0), (2, 0.4, 0.2), (4, 0.6, 0.3), (6, 0.5, 0.4))]
    events.append({"event": "eval", "method": "other", "round": 6, "self_acc": 1.0})
    summary = stream_summary(events, "m")
    assert summary["self_acc"] == {"a_last": 0.5, "a_auc": pytest.approx((0.4 + 0.6 + 0.5) / 3)}  # round 0 left out
    assert summary["others_acc"] == {"a_last": 0.4, "a_auc": pytest.approx(0.3)}


def test_stream_settings_that_cannot_hold_are_refused():
    run = copy.deepcopy(STREAM_RUN)
    run["data"]["stream"]["patterns"] = [[3, 0]]
    with pytest.raises(ConfigError, match=r"data\.stream\.patterns must be non-empty lists of rounds >= 1"):
        load_config(run)
    run = copy.deepcopy(STREAM_RUN)
    run["data"]["tasks"][0]["stream"] = {"mode": "static"}
    with pytest.raises(ConfigError, match=r"data\.tasks\['a'\]\.stream belongs to the run: set data\.stream"):
        load_config(run)


@pytest.mark.usefixtures("ray_local")
def test_a_stream_run_reports_self_and_others_per_round_and_their_a_last_and_a_auc(tmp_path):
    in_process = {**STREAM_RUN, "placement": {**STREAM_RUN["placement"], "executor": "local"}}
    summary = Simulation(in_process, out_dir=tmp_path, progress=False).run()
    stream = summary["methods"]["fedavg"]["stream"]
    assert set(stream) == {"self_acc", "others_acc"} and all(set(v) == {"a_last", "a_auc"} for v in stream.values())
    assert stream["self_acc"]["a_last"] == pytest.approx(summary["methods"]["fedavg"]["mean"]["self_acc"])
    report = (tmp_path / "report.md").read_text()
    assert "A_last and A_AUC" in report and "self_acc: a_auc" in report
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_the_offline_dynamic_stream_config_validates():
    config = load_config(ROOT / "configs" / "streams" / "dynamic.yaml")
    assert config.data.stream.mode == "dynamic" and [t.clients for t in config.data.tasks] == [(0, 1), (2, 3), (0, 1, 2, 3)]
