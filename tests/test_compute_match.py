"""train.compute_match: local steps per method from its local update's measured FLOPs relative to a reference."""

from __future__ import annotations

import copy
import json

import pytest

from rayfed.compute import matched_steps
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.method import LocalResult, Method
from rayfed.simulation import Simulation

from conftest import TINY_RUN


class TrainedTwice(Method):
    """FedAvg whose local update trains twice from the received model (twice FedAvg's FLOPs per step) and reports
    the steps it trained in each round event's ``client_stats``."""

    def local_update(self, client, state, payload):
        client.train({**state["personal"], **(payload or {})}, purpose="first_pass")
        result = super().local_update(client, state, payload)
        return LocalResult(result.state, result.upload, result.train_loss, stats={"steps": client.default_steps()})


def _config(**train) -> dict:
    config = copy.deepcopy(TINY_RUN)
    config["train"].update(local_steps=4, **train)
    config["placement"] = {"executor": "local", "clients_per_actor": 2}
    return config


def _run(config: dict, tmp_path) -> dict:
    return Simulation(config, out_dir=tmp_path, progress=False).run()


def test_a_method_costing_twice_the_reference_trains_half_the_steps_and_the_summary_says_so(tmp_path):
    config = _config(compute_match={"reference": "fedavg"})
    config["methods"] = ["fedavg", {"name": TrainedTwice, "label": "twice"}]
    summary = _run(config, tmp_path)
    matched = summary["compute_match"]
    assert matched["fedavg"]["cost_ratio"] == 1.0 and matched["fedavg"]["local_steps"] == 4
    assert matched["twice"]["cost_ratio"] == pytest.approx(2.0, rel=0.02)
    assert matched["twice"]["local_steps"] == 2
    assert matched["twice"]["flops"] > matched["fedavg"]["flops"] > 0
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [e["client_stats"]["steps"] / len(e["participants"]) for e in rounds
             if e["event"] == "round" and e["method"] == "twice"]
    assert steps == [2.0] * config["federation"]["rounds"]  # the steps the clients trained
    assert json.loads((tmp_path / "summary.json").read_text())["compute_match"] == matched


def test_matching_to_the_only_method_changes_nothing_and_without_the_option_nothing_is_measured(tmp_path):
    plain = _run(_config(), tmp_path / "plain")
    matched = _run(_config(compute_match={"reference": "fedavg"}), tmp_path / "matched")
    assert "compute_match" not in plain
    assert matched["compute_match"]["fedavg"]["local_steps"] == 4
    assert matched["methods"] == plain["methods"] and matched["comm_bytes"] == plain["comm_bytes"]


def test_steps_are_the_reference_steps_over_the_cost_ratio_rounded_and_a_method_that_trains_nothing_keeps_them():
    matched = matched_steps({"sft": 100.0, "takfl": 129.4, "fedmkt": 157.4, "perada": 229.4, "zeroshot": 0.0}, "sft", 100)
    assert {label: m["local_steps"] for label, m in matched.items()} == \
        {"sft": 100, "takfl": 77, "fedmkt": 64, "perada": 44, "zeroshot": 100}
    assert matched["perada"]["cost_ratio"] == pytest.approx(2.294)
    with pytest.raises(ConfigError, match="reference = 'zeroshot' counts no FLOPs"):
        matched_steps({"sft": 1.0, "zeroshot": 0.0}, "zeroshot", 10)
    with pytest.raises(ConfigError, match="method 'huge' costs 30 times .* raise train.local_steps to at least 15"):
        matched_steps({"sft": 1.0, "huge": 30.0}, "sft", 10)


@pytest.mark.parametrize("compute_match, train, message", [
    ({"reference": "fedav"}, {}, r"train.compute_match.reference = 'fedav' is not a method label of this run; "
                                 r"allowed: fedavg\."),
    ({"reference": "fedavg", "client": 4}, {}, r"train.compute_match.client = 4 is not a client of this run; "
                                               r"allowed: 0\.\.3\."),
    ({"reference": "fedavg"}, {"local_epochs": 1}, r"train.compute_match scales train.local_steps, so it needs "
                                                   r"train.local_steps, not train.local_epochs\."),
])
def test_invalid_compute_matching_gets_one_sentence(compute_match, train, message):
    with pytest.raises(ConfigError, match=message):
        load_config(_config(compute_match=compute_match, **train))
