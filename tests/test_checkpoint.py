from __future__ import annotations

import importlib
import json
import shutil
import sys

import pytest
import torch
import yaml

from rayfed import registry
from rayfed.results.checkpoint import load_checkpoint, save_checkpoint
from rayfed.cli import main
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.methods.fedavg import FedAvg
from rayfed.methods.fedprox import FedProx, FedProxParams
from rayfed.simulation import Simulation


def test_round_trip_keeps_every_slot_including_empty_ones(tmp_path):
    server = {"global": {"head.weight": torch.randn(3, 2)}}
    clients = {0: {"personal": {}, "personal_model": {"head.weight": torch.randn(3, 2)}},
               7: {"personal": {}, "personal_model": {"head.weight": torch.randn(3, 2)}}}
    save_checkpoint(tmp_path, "ditto", 4, server, clients, {"counters": {"up_bytes": 10}})
    restored = load_checkpoint(tmp_path, "ditto")
    assert restored.round == 4 and restored.meta["counters"] == {"up_bytes": 10}
    assert torch.equal(restored.server["global"]["head.weight"], server["global"]["head.weight"])
    assert set(restored.clients) == {0, 7}
    for cid, state in clients.items():
        assert restored.clients[cid]["personal"] == {}
        assert torch.equal(restored.clients[cid]["personal_model"]["head.weight"], state["personal_model"]["head.weight"])


def test_a_newer_checkpoint_replaces_the_older_one_only_when_complete(tmp_path):
    state = {0: {"personal": {"w": torch.zeros(2)}}}
    save_checkpoint(tmp_path, "fedavg", 1, {}, state, {})
    save_checkpoint(tmp_path, "fedavg", 2, {}, {0: {"personal": {"w": torch.ones(2)}}}, {})
    assert json.loads((tmp_path / "fedavg" / "latest.json").read_text())["round"] == 2
    assert sorted(p.name for p in (tmp_path / "fedavg").glob("round_*")) == ["round_2"]
    assert torch.equal(load_checkpoint(tmp_path, "fedavg").clients[0]["personal"]["w"], torch.ones(2))


def test_no_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path, "fedavg") is None


def test_a_checkpoint_refuses_another_config_and_names_the_difference(tmp_path):
    config = load_config({"methods": [{"name": "fedprox", "mu": 0.5}]}).to_dict()
    save_checkpoint(tmp_path, "fedprox", 1, {}, {}, {"config": config})
    moved = {**config, "placement": {**config["placement"], "clients_per_actor": 4}}  # where actors run: no change
    assert load_checkpoint(tmp_path, "fedprox", moved).round == 1
    changed = load_config({"methods": [{"name": "fedprox", "mu": 0.25}]}).to_dict()
    with pytest.raises(ConfigError, match=r"was written with another config \(methods\[0\]\.params\.mu = 0\.5 there, "
                                          r"0\.25 now\)") as info:
        load_checkpoint(tmp_path, "fedprox", changed)
    assert "\n" not in str(info.value)


# Runs from Python and their records --------------------------------------------------------------------------------

USER_MODULE = '''
from dataclasses import dataclass

import rayfed
from rayfed.methods.fedavg import FedAvg


@dataclass(frozen=True)
class DampedParams:
    step: float = 1.0


@rayfed.register_method("damped")
class DampedAvg(FedAvg):
    """FedAvg whose server moves ``step`` of the way to the uploads' mean."""

    Params = DampedParams

    def aggregate(self, server, uploads):
        mean = super().aggregate(server, uploads)["global"]
        old = server["global"]
        return {**server, "global": {n: old[n] + self.params.step * (v - old[n]) for n, v in mean.items()}}
'''


def _tiny(tiny_run: dict, methods: list) -> dict:
    """Two rounds in this process, a checkpoint after each."""
    tiny_run["federation"].update(rounds=2, eval_every=2, checkpoint_every=1)
    return {**tiny_run, "placement": {"executor": "local"}, "methods": methods}


def _methods(summary_or_dir) -> dict:
    if not isinstance(summary_or_dir, dict):
        summary_or_dir = json.loads((summary_or_dir / "summary.json").read_text())
    return summary_or_dir["methods"]


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A method class in a module of the user's (on sys.path), imported by the test."""
    (tmp_path / "damped_avg.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "damped_avg", raising=False)
    module = importlib.import_module("damped_avg")
    yield module
    sys.modules.pop("damped_avg", None)


def _as_in_a_fresh_process(monkeypatch) -> None:
    """Only what the built-in modules registered (their classes and functions): what the driver registered, or a
    config dump registered for it, is gone."""
    builtins = {kind: {name: entry for name, entry in entries.items()
                       if entry.builtin and (isinstance(entry.obj, type) or callable(entry.obj))}
                for kind, entries in registry._ENTRIES.items()}
    monkeypatch.setattr(registry, "_ENTRIES", builtins)


def test_a_method_given_as_an_instance_or_a_class_reruns_from_config_yaml_with_its_hyperparameters(
        tiny_run, tmp_path, monkeypatch, user_module):
    methods = [{"name": user_module.DampedAvg(user_module.DampedParams(step=0.5)), "label": "instance"},
               {"name": user_module.DampedAvg, "step": 0.5, "label": "class"}]
    summary = Simulation(_tiny(tiny_run, methods), out_dir=tmp_path / "python", progress=False).run()
    assert _methods(summary)["instance"]["clients"] == _methods(summary)["class"]["clients"]
    record = yaml.safe_load((tmp_path / "python" / "config.yaml").read_text())
    assert record["imports"] == ["damped_avg"]
    assert [(m["name"], m["params"]) for m in record["methods"]] == [("damped", {"step": 0.5})] * 2

    _as_in_a_fresh_process(monkeypatch)
    monkeypatch.delitem(sys.modules, "damped_avg")  # nor the user's module imported
    rerun = tmp_path / "rerun"
    assert main(["run", str(tmp_path / "python" / "config.yaml"), "--out", str(rerun), "--quiet"]) == 0
    assert _methods(rerun) == _methods(summary)


class _Interrupt(Exception):
    pass


def _interrupt_after_round_one(sim, label, rounds_done):
    if rounds_done == 1:
        raise _Interrupt


def test_resume_keeps_an_instances_hyperparameters_and_refuses_changed_ones(tiny_run, tmp_path, monkeypatch):
    methods = [FedProx(FedProxParams(mu=0.5))]
    reference = Simulation(_tiny(tiny_run, methods), out_dir=tmp_path / "whole", progress=False).run()
    with pytest.raises(_Interrupt):
        Simulation(_tiny(tiny_run, methods), out_dir=tmp_path / "cut", progress=False,
                   callbacks=[_interrupt_after_round_one]).run()
    shutil.copytree(tmp_path / "cut", tmp_path / "edited")
    _as_in_a_fresh_process(monkeypatch)  # as `rayfed run --resume` does
    assert _methods(Simulation.resume(tmp_path / "cut", progress=False).run()) == _methods(reference)

    record = yaml.safe_load((tmp_path / "edited" / "config.yaml").read_text())
    record["methods"][0]["params"]["mu"] = 0.25
    (tmp_path / "edited" / "config.yaml").write_text(yaml.safe_dump(record))
    with pytest.raises(ConfigError, match=r"\(methods\[0\]\.params\.mu = 0\.5 there, 0\.25 now\)"):
        Simulation.resume(tmp_path / "edited", progress=False).run()


def test_a_method_class_of_the_driver_script_runs_and_its_record_says_how_to_rerun_it(tiny_run, tmp_path, caplog):
    script_class = type("ScriptAvg", (FedAvg,), {"__module__": "__main__"})
    tiny_run = _tiny(tiny_run, [script_class])
    tiny_run["federation"]["rounds"] = 1
    Simulation(tiny_run, out_dir=tmp_path, progress=False).run()
    note = ("methods[0].name: ScriptAvg is defined in the driver script (__main__), so this config reruns only in that "
            "process; to rerun it with `rayfed run`, move ScriptAvg into a module and list that module under imports.")
    assert (tmp_path / "config.yaml").read_text().startswith(f"# note: {note}\n")
    assert note in caplog.text
    recorded = load_config(tmp_path / "config.yaml").methods[0].name
    assert registry.resolve("method", recorded).obj is script_class  # in this process, it still reruns
