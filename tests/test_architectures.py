"""Clients of different architectures in one run, and a method's stage before round 1 on the actors."""

from __future__ import annotations

import copy
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rayfed.actors.client import ClientActor, run_methods
from rayfed.actors.driver import DriverActor
from rayfed.architectures import actor_slots, architecture_of
from rayfed.config import load_config
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError
from rayfed.method import Method, PreFederationStage
from rayfed.simulation import Simulation
from rayfed.simulation.placement import fitted_slots, gpus_holding
from rayfed.tasks import sample_round

TWO_SIZES = {
    "name": "two-sizes", "seed": 4,
    "data": {"source": "multimodal:vqa", "options": {"num_samples": 96}, "num_clients": 4, "partition": {"name": "iid"}},
    "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 2}},
    "architectures": {"small": {"clients": [0, 1], "backbone": "tiny-pretrained:llava"},
                      "large": {"clients": [2, 3], "backbone": "tiny-pretrained:llava-large", "gpus_per_actor": 0}},
    "federation": {"rounds": 2, "clients_per_round": 4},
    "train": {"local_steps": 2, "batch_size": 8, "lr": 0.003, "optimizer": "adam"},
    "methods": ["fedavg"], "placement": {"clients_per_actor": 2, "cpus_per_actor": 0.5},
}


def _drive(config, participants: list[int] | None = None, rounds: int = 2) -> list[dict[str, torch.Tensor]]:
    """Run FedAvg in-process over the config's actors; the server state after each round."""
    federation = build_federation(config.data, config.seed)
    methods = run_methods(config, federation)
    actors = [(ClientActor(config, slot.client_ids, methods, architecture=slot.architecture), slot)
              for slot in actor_slots(config)]
    driver = DriverActor(config, methods)
    first = {}
    for actor, slot in actors:
        shared = actor.start_method(0)
        first.setdefault(slot.architecture, (shared, actor.task_tags()))
    names = list(first)
    driver.start_method(0, names, *(first[n][0] for n in names), *(first[n][1] for n in names))
    states = []
    for round_idx in range(rounds):
        sampled = participants if participants is not None else sample_round(config, round_idx)
        parts = [actor.train_round(round_idx, [c for c in sampled if c in slot.client_ids], driver.payloads(
            [c for c in sampled if c in slot.client_ids]), {c: 1.0 for c in sampled})
                 for actor, slot in actors if any(c in slot.client_ids for c in sampled)]
        driver.aggregate(*parts)
        states.append({n: v.clone() for n, v in driver.get_state()["global"].items()})
    return states


def test_each_architectures_fedavg_is_fedavg_over_its_own_clients_alone():
    config = load_config(TWO_SIZES)
    assert architecture_of(config) == ["small", "small", "large", "large"]
    assert [(s.architecture, s.client_ids) for s in actor_slots(config)] == [("small", (0, 1)), ("large", (2, 3))]
    both = _drive(config)
    small_names = {n for n in both[0] if n.startswith("small/")}
    large_names = {n for n in both[0] if n.startswith("large/")}
    assert small_names and large_names and small_names | large_names == set(both[0])
    # the small architecture's aggregate: bitwise FedAvg of a run where only its clients take part
    alone = _drive(load_config({k: v for k, v in TWO_SIZES.items() if k != "architectures"}), participants=[0, 1])
    for round_both, round_alone in zip(both, alone):
        for name, value in round_alone.items():
            assert torch.equal(round_both[f"small/{name}"], value), name
    # the large model's tensors are larger, and no tensor is shared across architectures
    width = {n.split("/", 1)[1]: v.shape for n, v in both[0].items() if n.startswith("large/")}
    assert any(width[n.split("/", 1)[1]] != v.shape for n, v in both[0].items() if n.startswith("small/")
               and n.split("/", 1)[1] in width)


def test_a_client_in_two_architectures_or_in_none_is_refused():
    run = copy.deepcopy(TWO_SIZES)
    run["architectures"]["large"]["clients"] = [1, 2, 3]
    with pytest.raises(ConfigError, match=r"architectures: client 1 is in both 'small' and 'large'"):
        load_config(run)
    run["architectures"]["large"]["clients"] = [2]
    with pytest.raises(ConfigError, match=r"architectures: client 3 is in no architecture; list every client 0\.\.3"):
        load_config(run)
    run["architectures"]["large"]["clients"] = [2, 3, 4]
    with pytest.raises(ConfigError, match=r"architectures\.large\.clients names client 4, but clients are 0\.\.3"):
        load_config(run)


def test_an_architecture_whose_backbone_cannot_run_the_task_names_it(tmp_path):
    run = copy.deepcopy(TWO_SIZES)
    run["architectures"]["large"]["backbone"] = "tiny-pretrained:llama-small"
    with pytest.raises(ConfigError, match=r"architectures\.large\.backbone = 'tiny-pretrained:llama-small' reads text "
                                          r"only and cannot run data\.kind = 'classification' on the images"):
        Simulation(run, out_dir=tmp_path, progress=False).run()


@dataclass(frozen=True)
class StageParams:
    marker_dir: str = ""


class AlignedStart(Method):
    """Before round 1, on each architecture's actor: the mean of its initial LoRA B matrices' norms over the public
    data's first batch (a stand-in for an alignment); the server keeps it per architecture."""

    Params = StageParams
    stages = (PreFederationStage(),)

    def pre_federation(self, stage):
        batch = next(stage.batches(batch_size=4, steps=1))
        with torch.no_grad():
            features = stage.model.features({k: v for k, v in batch.items() if k != "labels"})
        (Path(self.params.marker_dir) / f"{stage.architecture}-{uuid.uuid4().hex}").write_text("called")
        return {"feature_mean": features.mean(0)}

    def before_federation(self, server, prepared):
        return {**server, "prepared": {f"{arch}/feature_mean": t["feature_mean"] for arch, t in prepared.items()}}


def _staged_run(marker_dir: Path, **placement) -> dict:
    run = copy.deepcopy(TWO_SIZES)
    run["data"].update(num_clients=8, options={"num_samples": 192})
    run["architectures"]["small"]["clients"], run["architectures"]["large"]["clients"] = [0, 1, 2, 3], [4, 5, 6, 7]
    run["data"]["public"] = {"source": "multimodal:vqa", "options": {"num_samples": 16}}
    run["methods"] = [{"name": AlignedStart, "label": "aligned", "marker_dir": str(marker_dir)}]
    run["federation"].update(rounds=3, clients_per_round=4, checkpoint_every=1)
    run["placement"].update(placement)
    return run


@pytest.mark.usefixtures("ray_local")
def test_architectures_and_the_pre_federation_stage_keep_packing_and_resume_invariance(tmp_path):
    reference_markers = tmp_path / "m-ref"
    reference_markers.mkdir()
    reference = Simulation(_staged_run(reference_markers, clients_per_actor=4), out_dir=tmp_path / "ref",
                           progress=False).run()
    assert sorted(p.name.split("-")[0] for p in reference_markers.iterdir()) == ["large", "small"]  # once per architecture
    assert set(reference["methods"]["aligned"]["architectures"]) == {"small", "large"}

    def results(summary):
        return {"methods": summary["methods"], "comm_bytes": summary["comm_bytes"]}

    class Interrupt(Exception):
        pass

    def interrupt(sim, label, rounds_done):
        if rounds_done == 2:
            raise Interrupt

    markers = tmp_path / "m-cut"
    markers.mkdir()
    # One client per actor this time (eight actors, run in this process): neither packing nor resuming changes a number
    with pytest.raises(Interrupt):
        Simulation(_staged_run(markers, clients_per_actor=1, executor="local"), out_dir=tmp_path / "cut", progress=False,
                   callbacks=[interrupt]).run()
    assert len(list(markers.iterdir())) == 2
    resumed = Simulation.resume(tmp_path / "cut", progress=False).run()
    assert len(list(markers.iterdir())) == 2  # the stage is not run again on resume
    assert results(resumed) == results(reference)
    events = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3]


def test_actors_that_leave_cpus_per_actor_unset_share_what_the_cluster_has_left():
    config = {**TWO_SIZES, "data": {**TWO_SIZES["data"], "num_clients": 5}, "placement": {"clients_per_actor": 1}}
    config["architectures"] = {"small": {"clients": [0, 1, 2], "backbone": "tiny-pretrained:llava"},
                               "large": {"clients": [3, 4], "backbone": "tiny-pretrained:llava", "cpus_per_actor": 0.5}}
    config = load_config(config)

    def cpus(free):
        return [slot.cpus for slot in actor_slots(config, free)]

    assert cpus(None) == cpus(16) == [1, 1, 1, 0.5, 0.5]  # unset: 1 CPU each where there is room
    assert cpus(3) == [0.6666] * 3 + [0.5, 0.5]  # what the set ones leave, in whole ten-thousandths as Ray counts
    assert cpus(1) == [1, 1, 1, 0.5, 0.5]  # nothing left: the resource check refuses the run


def test_the_resource_check_fits_unset_cpus_to_the_cluster_and_refuses_set_ones_that_do_not_fit(
        tiny_run, tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    tiny_run["placement"] = {"clients_per_actor": 1}  # 4 ClientActors on 2 CPUs
    simulation = Simulation(tiny_run, out_dir=tmp_path, progress=False)
    assert [slot.cpus for slot in fitted_slots(simulation.config)] == [0.5] * 4
    tiny_run["placement"]["cpus_per_actor"] = 1
    simulation = Simulation(tiny_run, out_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match=r"^placement: 4 ClientActors x 1 CPU \(\+ 0 for the driver\) need 4 CPU but "
                                          r"the Ray cluster has 2; raise placement\.clients_per_actor or lower "
                                          r"placement\.cpus_per_actor\.$"):
        fitted_slots(simulation.config)


def test_the_resource_check_refuses_gpu_shares_whose_sum_fits_but_whose_pieces_do_not(tiny_run, tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray.util, "get_current_placement_group", lambda: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 3.0})
    tiny_run["placement"] = {"clients_per_actor": 1, "gpus_per_actor": 0.75}  # 4 ClientActors: 3.0 GPUs in all
    simulation = Simulation(tiny_run, out_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match=r"^placement: 4 ClientActors x 0\.75 GPU take 4 GPUs, as Ray gives a share "
                                          r"below 1 a place on one GPU, but the Ray cluster has 3; lower "
                                          r"placement\.gpus_per_actor \(to 0\.5 here\) or raise "
                                          r"placement\.clients_per_actor\.$"):
        fitted_slots(simulation.config)
    tiny_run["placement"]["gpus_per_actor"] = 0.5
    simulation = Simulation(tiny_run, out_dir=tmp_path, progress=False)
    assert [slot.gpus for slot in fitted_slots(simulation.config)] == [0.5] * 4


def test_gpus_holding_packs_shares_below_one_a_gpu_each_and_whole_shares_apart():
    assert gpus_holding([]) == gpus_holding([0.0, 0.0]) == 0
    assert gpus_holding([0.8] * 5) == 5  # the sum, 4.0, would fit 4 GPUs
    assert gpus_holding([0.5] * 5) == 3
    assert gpus_holding([0.6, 0.4, 0.6, 0.4]) == 2  # largest first: 0.6 + 0.4 twice
    assert gpus_holding([0.7, 0.3, 0.3, 0.7]) == 2
    assert gpus_holding([2.0, 1.0, 0.25, 0.25, 0.25, 0.25, 0.01]) == 5


def test_packing_by_cost_gives_a_costlier_architecture_more_actors_and_cuts_runs_of_equal_cost():
    """Eight clients of a 3x costlier model (3B beside 1B) and eight of the smaller one: the four actors that
    clients_per_actor gives carry costs 12, 12, 4, 4 by count, but 8, 9, 6, 9 by cost."""
    run = copy.deepcopy(TWO_SIZES)
    run["data"]["num_clients"] = 16
    run["architectures"]["small"]["clients"], run["architectures"]["large"]["clients"] = list(range(8)), list(range(8, 16))
    run["placement"]["clients_per_actor"] = 4
    config = load_config(run)
    costs = [1.0] * 8 + [3.0] * 8

    def loads(slots):
        return [sum(costs[c] for c in slot.client_ids) for slot in slots]

    assert loads(actor_slots(config)) == [4, 4, 12, 12]
    by_cost = actor_slots(config, costs=costs)
    assert [(slot.architecture, slot.client_ids) for slot in by_cost] == [
        ("small", tuple(range(8))), ("large", (8, 9, 10)), ("large", (11, 12)), ("large", (13, 14, 15))]
    assert loads(by_cost) == [8, 9, 6, 9]
    assert [slot.cpus for slot in by_cost] == [0.5] * 4  # each architecture's resources, as by count


def test_a_clients_cost_is_its_backbones_parameters_times_its_local_steps(tiny_run):
    from rayfed.config import architecture_model_config
    from rayfed.models import build_backbone
    from rayfed.simulation.placement import planned_costs

    assert planned_costs(load_config(tiny_run)) is None  # packing by count, the default, measures nothing
    run = {**tiny_run, "architectures": {"vit": {"clients": [0, 1], "backbone": "tiny:vit"},
                                         "clip": {"clients": [2, 3], "backbone": "tiny:clip-vision"}}}
    run["placement"]["balance_by"] = "cost"
    run["train"].update(local_epochs=1, batch_size=8)  # steps: one per 8 samples
    config = load_config(run)
    costs = planned_costs(config, {0: 8, 1: 16, 2: 8, 3: 24})
    params = {name: sum(p.numel() for p in build_backbone(architecture_model_config(config, name), 0).encoder.parameters())
              for name in ("vit", "clip")}
    assert params["vit"] != params["clip"]
    assert costs == [params["vit"], 2 * params["vit"], params["clip"], 3 * params["clip"]]


def test_packing_by_cost_changes_the_actors_but_not_a_number(tiny_run, tmp_path):
    run = {**tiny_run, "architectures": {"vit": {"clients": [0, 1, 2], "backbone": "tiny:vit"},
                                         "clip": {"clients": [3, 4, 5], "backbone": "tiny:clip-vision"}}}
    run["data"]["num_clients"] = 6
    run["federation"].update(rounds=2, clients_per_round=6)
    run["placement"].update(executor="local", clients_per_actor=2)
    by_count = Simulation(run, out_dir=tmp_path / "count", progress=False)
    run["placement"]["balance_by"] = "cost"
    by_cost = Simulation(run, out_dir=tmp_path / "cost", progress=False)
    seen = {}

    def record(sim, label, rounds_done):
        seen[sim.run_dir.name] = [(slot.architecture, slot.client_ids) for slot in sim.run_actors.slots]

    by_count.callbacks = by_cost.callbacks = [record]
    count_summary, cost_summary = by_count.run(), by_cost.run()
    assert seen["count"] == [("vit", (0, 1)), ("vit", (2,)), ("clip", (3, 4)), ("clip", (5,))]
    assert seen["cost"] != seen["count"]
    assert cost_summary["methods"] == count_summary["methods"]
    assert cost_summary["comm_bytes"] == count_summary["comm_bytes"]
