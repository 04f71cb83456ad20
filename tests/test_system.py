"""Client dropout and stragglers: seeded, method-independent, recorded per round."""

from __future__ import annotations

import json

import pytest
import torch

from rayfed.config import load_config
from rayfed.simulation import Simulation
from rayfed.system import client_speed, plan_round


def test_dropout_one_drops_every_sampled_client(tiny_run):
    config = load_config(tiny_run, ["system.dropout=1.0"])
    plan = plan_round(config, 0, [0, 1, 3], {0: 50, 1: 50, 2: 50, 3: 50})
    assert plan.participants == [] and plan.dropped == [0, 1, 3]


def test_dropout_is_seeded_and_roughly_its_probability(tiny_run):
    config = load_config(tiny_run, ["system.dropout=0.3"])
    sizes = {c: 50 for c in range(4)}
    plans = [plan_round(config, r, [0, 1, 2, 3], sizes) for r in range(200)]
    assert plans == [plan_round(config, r, [0, 1, 2, 3], sizes) for r in range(200)]
    rate = sum(len(p.dropped) for p in plans) / 800
    assert 0.25 < rate < 0.35


def test_deadline_excludes_exactly_the_slow_client(tiny_run):
    config = load_config(tiny_run, ["system.speeds={2: 0.1}", "system.deadline=10"])  # 3 steps: 3 vs 30 time units
    plan = plan_round(config, 0, [0, 1, 2, 3], {c: 50 for c in range(4)})
    assert plan.late == [2] and plan.participants == [0, 1, 3]
    assert plan.sim_time == 10.0  # the server waits until the deadline for the late client


def test_late_clients_can_be_down_weighted_instead(tiny_run):
    config = load_config(tiny_run, ["system.speeds={2: 0.1}", "system.deadline=10",
                                    "system.late_policy=downweight", "system.late_weight=0.25"])
    plan = plan_round(config, 0, [1, 2], {c: 50 for c in range(4)})
    assert plan.participants == [1, 2] and plan.weight_scale == {1: 1.0, 2: 0.25}


def test_speed_factors_are_fixed_per_client_and_seeded(tiny_run):
    config = load_config(tiny_run, ["system.speed_sigma=0.5"])
    speeds = [client_speed(config, c) for c in range(4)]
    assert speeds == [client_speed(config, c) for c in range(4)] and len(set(speeds)) == 4


def test_speeds_must_name_existing_clients(tiny_run):
    with pytest.raises(ValueError, match="system.speeds names client 9"):
        load_config(tiny_run, ["system.speeds={9: 0.5}"])


def test_a_round_with_dropout_one_leaves_the_server_state_unchanged(tiny_run, tmp_path):
    tiny_run["system"] = {"dropout_by_round": {2: 1.0}}
    tiny_run["placement"]["executor"] = "local"
    server_after = {}

    def record(sim, label, rounds_done):
        server_after[rounds_done] = sim.executor.get(sim.driver.get_state.remote())

    Simulation(tiny_run, out_dir=tmp_path, progress=False, callbacks=[record]).run()
    unchanged = server_after[1]["global"], server_after[2]["global"]
    assert all(torch.equal(unchanged[0][n], unchanged[1][n]) for n in unchanged[0])
    assert any(not torch.equal(server_after[2]["global"][n], server_after[3]["global"][n]) for n in unchanged[0])
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    round_2 = next(e for e in events if e["event"] == "round" and e["round"] == 2)
    assert round_2["participants"] == [] and round_2["dropped"] == round_2["clients"] and round_2["up_bytes"] == 0
