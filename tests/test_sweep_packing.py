"""benchmarks/sweep_packing.py's pure parts: the sweeps it builds from a paper twin, and its arithmetic."""

from __future__ import annotations

import pytest

from rayfed.benchmarks.sweep_packing import (WORKLOADS, fewer_clients, most_at_once, one_at_a_time, packed,
                                             same_metrics, span_s, sweep_config, trials_per_hour)
from rayfed.config import build_config
from rayfed.errors import ConfigError
from rayfed.tune.space import SearchSpace


def test_the_tap_sweep_is_its_twin_shortened_and_both_ways_differ_only_in_placement_and_concurrency():
    raw = sweep_config(WORKLOADS["tap"], rounds=1, steps=2, clients=10, samples=160)
    config = build_config({**raw, "tune": None})
    assert [entry.label for entry in config.methods] == ["TAP"]
    assert config.model.backbone == "flava:full" and config.train.batch_size == 32 and config.train.grad_accum == 4
    assert config.data.num_clients == 10 and config.federation.clients_per_round == 2
    assert (config.federation.rounds, config.federation.eval_every, config.federation.checkpoint_every) == (1, 2, 0)
    assert config.train.local_steps == 2 and config.methods[0].params["post_fl_microbatches"] == 4
    samples = {task.name: task.options["num_samples"] for task in config.data.tasks}
    assert samples["agnews"] == 160 * 3  # clients 1, 2, 7
    assert len(list(SearchSpace(raw["tune"]["space"], "grid").param_space().values())) == 2  # 3 x 2 trials

    one = build_config(one_at_a_time(raw, gpus=1))
    assert (one.placement.clients_per_actor, one.placement.gpus_per_actor) == (8, 0.5)  # 2 actors share the GPU
    assert one.tune["max_concurrent_trials"] == 1
    assert build_config(one_at_a_time(raw, gpus=2)).placement.gpus_per_actor == 1.0
    many = build_config(packed(raw, None))
    assert (many.placement.clients_per_actor, many.placement.gpus_per_actor) == (10, "measured")
    assert "max_concurrent_trials" not in many.tune
    for way in (one, many):
        assert way.model_copy(update={"placement": config.placement, "tune": None}) == config


def test_fewer_clients_keeps_each_tasks_clients_below_the_count_and_refuses_a_task_left_without():
    data = {"tasks": [{"name": "a", "clients": [0, 3, 5], "options": {"num_samples": 300}},
                      {"name": "b", "clients": [1, 2, 4]}]}
    kept = fewer_clients(data, 3, None)
    assert kept["tasks"][0] == {"name": "a", "clients": [0], "options": {"num_samples": 100}}
    assert kept["tasks"][1]["clients"] == [1, 2] and data["tasks"][0]["clients"] == [0, 3, 5]
    assert fewer_clients(data, 3, 50)["tasks"][1]["options"] == {"num_samples": 100}
    with pytest.raises(ConfigError, match=r"^data.tasks\['a'\] has no client below 0; keep more clients\.$"):
        fewer_clients(data, 0, None)
    assert fewer_clients({"num_clients": 20, "source": "x"}, 4, None) == {"num_clients": 4, "source": "x"}


def test_trials_per_hour_overlap_and_equal_metrics():
    assert trials_per_hour(4, 1800.0) == 8.0 and trials_per_hour(3, 0.0) == 0.0
    assert most_at_once([(0, 10), (5, 15), (10, 20), (12, 13)]) == 3  # (5, 15), (10, 20) and (12, 13) at 12
    assert most_at_once([]) == 0
    assert span_s([(5, 15), (10, 20), (12, 13)]) == 15 and span_s([]) == 0.0
    first = [{"params": {"lr": "0.1"}, "status": "completed", "metric": 0.5},
             {"params": {"lr": "0.2"}, "status": "error", "metric": None}]
    assert same_metrics(first, [{"params": {"lr": "0.1"}, "status": "completed", "metric": 0.5}]) is True
    assert same_metrics(first, [{"params": {"lr": "0.1"}, "status": "completed", "metric": 0.6}]) is False
    assert same_metrics(first, [{"params": {"lr": "0.2"}, "status": "completed", "metric": 0.6}]) is None
