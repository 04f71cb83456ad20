"""``gpus_per_actor: measured``: the share from a (here injected) probe's peak, its rounding, its cache, its errors, the
config's check, the probe's own run of the actor code, and Tune trials sized by it."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import ray
import torch

from conftest import TINY_RUN
from rayfed.architectures import actor_slots
from rayfed.config import load_config
from rayfed.errors import ConfigError
from rayfed.simulation import gpu_memory
from rayfed.simulation.gpu_memory import (GpuMemory, Measurement, costliest_slots, peak_memory, probe_clients,
                                          probe_on_gpu)
from rayfed.simulation.placement import fitted_slots
from rayfed.tune import trial_resources

GIB = 2**30


class FakeProbe:
    """A probe that reports ``peak_gib`` on a GPU of ``gpu_gib`` and counts its calls."""

    def __init__(self, peak_gib: float, gpu_gib: float = 80.0):
        self.peak_gib, self.gpu_gib, self.calls = peak_gib, gpu_gib, []

    def __call__(self, config, name, slot):
        self.calls.append((name, slot))
        return Measurement(slot, int(self.peak_gib * GIB), "Fake GPU", int(self.gpu_gib * GIB))


def _measured(**placement) -> dict:
    config = copy.deepcopy(TINY_RUN)
    config["data"]["num_clients"] = 7
    config["placement"] = {"clients_per_actor": 3, "cpus_per_actor": 0.5, "gpus_per_actor": "measured", **placement}
    return config


@pytest.mark.parametrize(("peak_gib", "headroom_gib", "gpu_gib", "share"), [
    (38.0, 2.0, 80.0, 0.5),     # exactly half: not rounded past it
    (30.5, 2.0, 140.0, 0.24),   # 0.2321... rounded up
    (0.001, 0.0, 80.0, 0.01),   # never below one step
    (77.0, 3.0, 80.0, 1.0),
])
def test_the_share_is_peak_plus_headroom_over_the_gpu_rounded_up_to_a_hundredth(peak_gib, headroom_gib, gpu_gib, share):
    measurement = Measurement((0,), int(peak_gib * GIB), "Fake GPU", int(gpu_gib * GIB))
    assert measurement.share(headroom_gib) == share


def test_trial_resources_ask_for_the_measured_share_and_numbers_stay_as_configured():
    probe = FakeProbe(peak_gib=18.5)  # + 2 GiB headroom = 20.5 / 80 = 0.25625 -> 0.26
    resources = trial_resources(load_config(_measured()), GpuMemory(probe=probe))
    assert resources.bundles == [{"CPU": 0.25}] + [{"CPU": 0.5, "GPU": 0.26}] * 3
    assert probe.calls == [("", (0, 1, 2))]  # one probe: the first of the fullest actors
    local = trial_resources(load_config(_measured(executor="local")), GpuMemory(probe=FakeProbe(18.5)))
    assert local.bundles == [{"CPU": 0.5, "GPU": 0.26}]
    numbers = trial_resources(load_config(_measured(gpus_per_actor=0.3)), GpuMemory(probe=probe))
    assert numbers.bundles == [{"CPU": 0.25}] + [{"CPU": 0.5, "GPU": 0.3}] * 3 and len(probe.calls) == 1


def test_an_architecture_measures_its_own_share_beside_one_of_a_number(tiny_run):
    tiny_run["architectures"] = {"a": {"clients": [0, 1], "backbone": "tiny:vit", "gpus_per_actor": 0.4},
                                 "b": {"clients": [2, 3], "backbone": "tiny:vit", "gpus_per_actor": "measured"}}
    probe = FakeProbe(peak_gib=6.0)
    slots = actor_slots(config := load_config(tiny_run), measured=GpuMemory(probe=probe).shares(config))
    assert [(s.architecture, s.gpus) for s in slots] == [("a", 0.4), ("b", 0.1)]
    assert probe.calls == [("b", (2, 3))]


def test_the_cache_measures_a_configuration_once_and_again_when_memory_may_change(tmp_path):
    path, probe = tmp_path / "gpu_memory.json", FakeProbe(peak_gib=10.0)
    config = load_config(_measured())
    assert GpuMemory(path, probe).shares(config) == {"": 0.15}
    assert GpuMemory(path, probe).shares(config) == {"": 0.15}  # read back from the file
    kept = json.loads(path.read_text())
    assert list(kept.values()) == [{"clients": [0, 1, 2], "peak_bytes": 10 * GIB, "gpu_name": "Fake GPU",
                                    "gpu_bytes": 80 * GIB}]
    # floats of train and of the methods (rates, margins, temperatures), the rounds and the headroom: no new probe
    same_memory = load_config(_measured(memory_headroom_gib=6.0),
                              ["train.lr=0.5", "methods=[{name: fedprox, mu: 0.3}]", "federation.rounds=9"])
    fedprox = load_config(_measured(), ["methods=[{name: fedprox, mu: 0.01}]"])
    memory = GpuMemory(path, probe)
    memory.shares(fedprox)
    assert memory.shares(same_memory) == {"": 0.2} and len(probe.calls) == 2  # (10 + 6) / 80
    memory.shares(load_config(_measured(), ["train.batch_size=16"]))
    memory.shares(load_config(_measured(clients_per_actor=4)))
    assert len(probe.calls) == 4
    assert probe.calls[-1] == ("", (0, 1, 2, 3))


def test_a_cache_file_rayfed_did_not_write_is_one_sentence(tmp_path):
    (path := tmp_path / "gpu_memory.json").write_text('{"abc": {"peak_bytes": "x"}}')
    with pytest.raises(ConfigError, match=r"^\S+gpu_memory.json is not a file of GPU memory measurements rayfed wrote; "
                                          r"delete it to measure again\.$"):
        GpuMemory(path)


def test_an_actor_larger_than_its_gpu_is_one_sentence_naming_the_architecture_and_sizes(tiny_run):
    tiny_run["architectures"] = {"big": {"clients": [0, 1, 2, 3], "backbone": "tiny:vit", "gpus_per_actor": "measured"}}
    with pytest.raises(ConfigError) as raised:
        GpuMemory(probe=FakeProbe(peak_gib=79.0)).shares(load_config(tiny_run))
    message = str(raised.value)
    assert message.startswith(
        "placement.gpus_per_actor: measured: an actor of architecture 'big' hosting 2 clients needs 81.0 GiB (a peak "
        "of 79.0 GiB + 2 GiB of placement.memory_headroom_gib) but the GPU (Fake GPU) has 80.0 GiB; lower "
        "clients_per_actor")
    assert message.count(". ") == 0 and message.endswith(".")


def test_measuring_without_a_gpu_is_one_sentence(monkeypatch):
    config = load_config(_measured())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match=r"^placement.gpus_per_actor: measured needs a GPU to measure an actor's "
                                          r"memory on, and this process \(Ray is not running\) has none; set it to a "
                                          r"number \(0: the actors train on CPUs\)\.$"):
        probe_on_gpu(config, "", (0, 1, 2))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 4.0})
    with pytest.raises(ConfigError, match=r"and the Ray cluster has none; set it to a number"):
        probe_on_gpu(config, "", (0, 1, 2))


@pytest.mark.parametrize("value", ["auto", -0.5, True, [0.5], "nan"])
def test_gpus_per_actor_is_a_number_or_measured_in_one_sentence(value, tiny_run):
    tiny_run["placement"]["gpus_per_actor"] = value
    with pytest.raises(ConfigError, match=r"^placement.gpus_per_actor = .* is invalid: it must be a number >= 0 \(the "
                                          r"share of a GPU an actor asks Ray for\) or 'measured' \(the share its "
                                          r"measured peak memory needs\)\.$"):
        load_config(tiny_run, ["placement.gpus_per_actor=.nan"] if value == "nan" else [])
    tiny_run["placement"]["gpus_per_actor"] = 1
    assert load_config(tiny_run).placement.gpus_per_actor == 1.0
    tiny_run["architectures"] = {"a": {"clients": [0, 1, 2, 3], "backbone": "tiny:vit", "gpus_per_actor": "auto"}}
    with pytest.raises(ConfigError, match=r"^architectures.a.gpus_per_actor = 'auto' is invalid: it must be a number"):
        load_config(tiny_run)


def test_slots_of_a_measured_share_need_it_unless_the_executor_is_local():
    with pytest.raises(ValueError, match="its GPU share is measured, and was not given"):
        actor_slots(load_config(_measured()))
    assert {slot.gpus for slot in actor_slots(load_config(_measured(executor="local")))} == {0.0}


def test_the_costliest_slot_has_the_most_clients_or_the_most_cost():
    config = load_config(_measured())
    assert costliest_slots(config) == {"": (0, 1, 2)}
    costs = [1.0, 1.0, 1.0, 5.0, 1.0, 1.0, 1.0]
    by_cost = load_config(_measured(balance_by="cost"))
    assert costliest_slots(by_cost, costs) == {"": (3,)}  # of (0, 1, 2), (3,), (4, 5, 6)
    assert costliest_slots(load_config(_measured(gpus_per_actor=0.5))) == {}


def test_the_probe_hosts_the_slot_and_the_largest_client_of_every_task_set():
    config = load_config(_measured())
    tasks_of = {0: (0,), 1: (0,), 2: (1,), 3: (1,), 4: (0, 1), 5: (1,), 6: (0, 1)}
    num_train = {0: 10, 1: 30, 2: 5, 3: 9, 4: 4, 5: 9, 6: 8}
    assert probe_clients(config, num_train, tasks_of, "", (0, 2)) == (0, 1, 2, 3, 6)


def test_the_probe_runs_every_method_on_the_real_actor_code_and_reads_the_allocator_peak(monkeypatch, tiny_run):
    """On a CPU, with torch's CUDA memory calls stood in for: the probe's actor, driver, updates and evaluations."""
    tiny_run["methods"] = ["fedavg", {"name": "ditto", "lam": 0.1, "post_train_steps": 2}]
    config = load_config(tiny_run)
    reset = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *device: reset.append(True))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *device: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *device: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *device: SimpleNamespace(name="Fake GPU", total_memory=80 * GIB))
    trained = []
    update = gpu_memory.ClientActor.train

    def train(actor, round_idx, client_ids, payloads):
        trained.append((actor.label, actor.train_config.local_steps, tuple(client_ids)))
        return update(actor, round_idx, client_ids, payloads)

    finished = []
    finish = gpu_memory.ClientActor.finish

    def end_of_run(actor, round_idx, payloads, post_train_steps):
        finished.append((actor.label, tuple(actor.client_ids), post_train_steps))
        return finish(actor, round_idx, payloads, post_train_steps)

    monkeypatch.setattr(gpu_memory.ClientActor, "train", train)
    monkeypatch.setattr(gpu_memory.ClientActor, "finish", end_of_run)
    measurement = peak_memory(config, "", (0, 1))
    assert measurement == Measurement(measurement.clients, 3 * GIB, "Fake GPU", 80 * GIB) and reset
    assert set(measurement.clients) >= {0, 1}
    assert trained == [("fedavg", 2, measurement.clients), ("ditto+post", 2, measurement.clients)]
    # the end of run of one client, the same for every method
    assert [(label, steps) for label, _, steps in finished] == [("fedavg", 0), ("ditto+post", 2)]
    assert finished[0][1] == finished[1][1] and len(finished[0][1]) == 1 and finished[0][1][0] in measurement.clients


def test_a_trial_gives_its_actors_the_share_its_bundles_hold(tiny_run, monkeypatch):
    tiny_run["placement"] = {"clients_per_actor": 2, "cpus_per_actor": 0.5, "gpus_per_actor": "measured"}
    group = SimpleNamespace(bundle_specs=[{"CPU": 0.25}, {"CPU": 0.5, "GPU": 0.37}, {"CPU": 0.5, "GPU": 0.37}])
    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: group)
    assert [slot.gpus for slot in fitted_slots(load_config(tiny_run))] == [0.37, 0.37]
