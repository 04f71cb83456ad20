"""End-to-end runs on local Ray: results contract, reproducibility, resume, actor failure."""

from __future__ import annotations

import copy
import json

import pytest
import ray
import yaml

from rayfed.config import load_config, with_full_params
from rayfed.errors import ConfigError
from rayfed.method import build_method
from rayfed.simulation import Simulation

pytestmark = pytest.mark.usefixtures("ray_local")

RESUMABLE = {"methods": ["fedavg", {"name": "ditto", "lam": 0.5}], "federation": {"checkpoint_every": 1}}


def _merge(base: dict, changes: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


IN_PROCESS = {"placement": {"executor": "local"}}
"""For tests of what a method or run computes, not of Ray: the same actors in the test's process."""


def _run(config: dict, out_dir, **kwargs) -> dict:
    return Simulation(config, out_dir=out_dir, progress=False, **kwargs).run()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The uninterrupted run that packing, resume and failure runs must reproduce."""
    from conftest import TINY_RUN

    config = _merge(TINY_RUN, RESUMABLE)
    return {"config": config, "summary": _run(config, tmp_path_factory.mktemp("reference"))}


def _results(summary: dict) -> dict:
    return {"methods": summary["methods"], "comm_bytes": summary["comm_bytes"]}


def test_run_writes_the_results_contract(tiny_run, tmp_path):
    tiny_run["methods"] = ["local", "fedavg", {"name": "fedavg", "post_train_steps": 4}, "ditto"]
    summary = _run(tiny_run, tmp_path)

    assert set(summary) == {"rayfed_version", "config", "methods", "wall_time_s", "comm_bytes", "comm_params",
                            "target_acc", "rounds_to_target"}
    assert list(summary["methods"]) == ["local", "fedavg", "fedavg+post", "ditto"]
    for label, result in summary["methods"].items():
        assert sorted(result["clients"], key=int) == ["0", "1", "2", "3"]
        accs = [client["local_acc"] for client in result["clients"].values()]
        assert result["mean"]["local_acc"] == pytest.approx(sum(accs) / len(accs))
        assert all(0.0 <= acc <= 1.0 for acc in accs)
        assert all(client["num_test"] > 0 for client in result["clients"].values())
    assert summary["comm_bytes"]["local"] == {"up": 0, "down": 0}
    assert summary["comm_bytes"]["fedavg"]["up"] > 0 and summary["comm_bytes"]["fedavg"]["down"] > 0
    assert summary["comm_bytes"]["fedavg"]["up"] == 4 * summary["comm_params"]["fedavg"]["up"]  # fp32
    assert summary["comm_params"]["local"] == {"up": 0, "down": 0}
    assert set(summary["rounds_to_target"]) == set(summary["methods"])
    assert json.loads((tmp_path / "summary.json").read_text()) == summary

    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all({"event", "method", "round"} <= set(e) for e in events)
    rounds = [e for e in events if e["event"] == "round" and e["method"] == "fedavg"]
    assert [e["round"] for e in rounds] == [1, 2, 3, 4]
    assert all(len(e["clients"]) == 3 and e["up_bytes"] > 0 for e in rounds)
    evals = [e for e in events if e["event"] == "eval" and e["method"] == "fedavg"]
    assert [e["round"] for e in evals] == [2, 4] and evals[-1]["final"]

    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    given = load_config(tiny_run)  # config.yaml holds it with every method's hyperparameters, defaults included
    assert load_config(saved) == with_full_params(given, [build_method(m, i).params for i, m in enumerate(given.methods)])
    report = (tmp_path / "report.md").read_text()
    assert "fedavg+post" in report and "ditto" in report
    assert (tmp_path / "curves.png").stat().st_size > 1000
    assert (tmp_path / "clients.png").stat().st_size > 1000


def test_packing_does_not_change_results(reference, tmp_path):
    """Ray actors of 2 clients (the reference) or of all 4, and one client per actor in this process (four more Ray
    actors would each start a worker and build a model for what the in-process actors compute the same way)."""
    one_per_actor = _run(_merge(reference["config"], {"placement": {"clients_per_actor": 1, "executor": "local"}}),
                         tmp_path / "a")
    all_in_one = _run(_merge(reference["config"], {"placement": {"clients_per_actor": 4}}), tmp_path / "b")
    assert _results(one_per_actor) == _results(reference["summary"])
    assert _results(all_in_one) == _results(reference["summary"])


def test_balanced_rounds_move_clients_between_actors_without_changing_a_number(reference, tmp_path):
    """The reference moves clients between its Ray actors; the pinned run's numbers come from this process."""
    pinned = _run(_merge(reference["config"], {"placement": {"balance_rounds": False, "executor": "local"}}),
                  tmp_path / "pinned")
    assert _results(pinned) == _results(reference["summary"])


def test_the_actor_busiest_last_round_gets_its_payloads_first(tiny_run, tmp_path, monkeypatch):
    """The DriverActor makes one actor's payloads after another's: the actor whose local updates took longest in the
    last round (in the first round, the one training the most clients) is served first."""
    import time

    from rayfed.actors.client import ClientActor

    order, train_round, local_updates = [], ClientActor.train_round, ClientActor._local_updates

    def recorded(actor, round_idx, client_ids, *args, **kwargs):
        order.append((round_idx, tuple(client_ids)))
        return train_round(actor, round_idx, client_ids, *args, **kwargs)

    def slow_on_client_2(actor, round_idx, client_ids, payloads):
        if 2 in client_ids:
            time.sleep(0.3)  # the actor of one client trains longest
        yield from local_updates(actor, round_idx, client_ids, payloads)

    monkeypatch.setattr(ClientActor, "train_round", recorded)
    monkeypatch.setattr(ClientActor, "_local_updates", slow_on_client_2)
    tiny_run["placement"]["executor"] = "local"  # actors of clients 0, 1 and of client 2
    tiny_run["data"]["num_clients"] = 3
    tiny_run["federation"].update({"rounds": 3, "clients_per_round": 3})
    _run(tiny_run, tmp_path)
    assert order == [(0, (0, 1)), (0, (2,)), (1, (2,)), (1, (0, 1)), (2, (2,)), (2, (0, 1))]


def test_uploads_go_on_ahead_only_after_a_round_that_took_at_most_half_the_object_store():
    """A ray.put that does not fit is spilled to disk and read back: then the uploads return with the round's call."""
    from rayfed.executors import LocalExecutor
    from rayfed.simulation.actors import RunActors

    actors = RunActors(None, [], None, LocalExecutor(), [])
    assert not actors.sends_ahead()  # in this process: no object store
    actors.object_store = 1000.0
    assert not actors.sends_ahead()  # a method's first round: its size is not known yet
    actors.store_bytes = 500
    assert actors.sends_ahead()
    actors.store_bytes = 501
    assert not actors.sends_ahead()


def test_a_round_larger_than_rays_object_store_is_said_once_with_the_setting_to_raise(tiny_run, tmp_path,
                                                                                       monkeypatch, capsys):
    from rayfed.simulation import actors

    monkeypatch.setattr(actors, "smallest_object_store", lambda: 1000.0)  # smaller than any round here
    tiny_run["federation"].update({"rounds": 2, "eval_every": 2})
    _run(tiny_run, tmp_path)
    said = [line for line in capsys.readouterr().out.splitlines() if "object store" in line]
    assert len(said) == 1 and said[0].startswith("[rayfed] fedavg: round 1's payloads and uploads took")
    assert "which holds 0.00 GB" in said[0] and "raise ray.object_store_memory" in said[0]
    rounds = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "round"]
    for event in rounds:  # 3 clients on 2 actors: the global model once a payload call, two float64 partial sums
        assert len(event["participants"]) == 3 and event["store_bytes"] == 2 * event["down_bytes"]


def test_actors_share_the_drivers_data_through_the_object_store(tiny_run, tmp_path):
    """The federation is built once, by the driver: every actor reads the same object-store copy (read-only
    views), not a dataset built again per actor."""
    seen = []

    def inspect(sim, label, rounds_done):
        if rounds_done == 1:
            seen.extend(ray.get([actor.__ray_call__.remote(lambda a: (
                a.federation.holdings[0].dataset.images.flags.writeable,
                a.federation.holdings[0].dataset.images.sum())) for actor in sim.actors]))
            seen.append(sim.federation.holdings[0].dataset.images.sum())

    tiny_run["placement"]["clients_per_actor"] = 2
    _run(tiny_run, tmp_path, callbacks=[inspect])
    *actors, driver_sum = seen
    assert len(actors) == 2
    assert [writeable for writeable, _ in actors] == [False, False]
    assert [total for _, total in actors] == [driver_sum, driver_sum]


def test_a_rounds_clients_are_spread_evenly_over_each_architectures_actors():
    from rayfed.architectures import ActorSlot
    from rayfed.simulation import balanced_assignment

    slots = [ActorSlot("a", (0, 1, 2), 1, 0), ActorSlot("a", (3, 4, 5), 1, 0), ActorSlot("b", (6, 7), 1, 0),
             ActorSlot("b", (8, 9), 1, 0)]
    host_of = {cid: index for index, slot in enumerate(slots) for cid in slot.client_ids}
    assignment = balanced_assignment([0, 1, 2, 5, 6, 7], slots, host_of)
    assert assignment == {0: [0, 1], 1: [2, 5], 2: [6], 3: [7]}  # shares 2/2 and 1/1; one mover each
    assert balanced_assignment([0, 1, 2, 3, 4], slots, host_of) == {0: [0, 1, 2], 1: [3, 4]}  # no move needed
    spread = balanced_assignment([0, 1, 2, 3, 4, 5, 6], slots, host_of)
    assert sorted(len(v) for k, v in spread.items() if k < 2) == [3, 3] and sum(map(len, spread.values())) == 7


def test_another_seed_changes_results(reference, tmp_path):
    other = _run(_merge(reference["config"], {"seed": 4, **IN_PROCESS}), tmp_path)
    assert other["methods"]["fedavg"]["clients"] != reference["summary"]["methods"]["fedavg"]["clients"]


class _Interrupt(Exception):
    pass


def test_resume_ends_with_the_uninterrupted_numbers(reference, tmp_path):
    def interrupt(sim, label, rounds_done):
        if label == "ditto" and rounds_done == 2:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        _run(reference["config"], tmp_path, callbacks=[interrupt])
    assert (tmp_path / "results" / "fedavg.json").is_file()
    assert not (tmp_path / "summary.json").exists()

    resumed = Simulation.resume(tmp_path, progress=False).run()
    assert _results(resumed) == _results(reference["summary"])
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ditto_rounds = [e["round"] for e in events if e["method"] == "ditto" and e["event"] == "round"]
    assert ditto_rounds == [1, 2, 3, 4]


def test_a_killed_actor_is_replaced_and_results_match(reference, tmp_path):
    killed = []

    def kill_an_actor(sim, label, rounds_done):
        if label == "fedavg" and rounds_done == 2 and not killed:
            ray.kill(sim.actors[1], no_restart=True)
            killed.append(rounds_done)

    summary = _run(reference["config"], tmp_path, callbacks=[kill_an_actor])
    assert killed == [2]
    assert _results(summary) == _results(reference["summary"])


def test_fedavg_with_one_client_equals_local_training(tiny_run, tmp_path):
    tiny_run["data"].update(num_clients=1, partition={"name": "iid"})
    tiny_run["federation"]["clients_per_round"] = 1
    tiny_run["methods"] = ["local", "fedavg"]
    summary = _run(_merge(tiny_run, IN_PROCESS), tmp_path)
    assert summary["methods"]["fedavg"]["clients"] == summary["methods"]["local"]["clients"]
    assert summary["comm_bytes"]["fedavg"]["up"] > 0


def test_fedprox_with_zero_mu_equals_fedavg(tiny_run, tmp_path):
    tiny_run["methods"] = ["fedavg", {"name": "fedprox", "mu": 0.0}, {"name": "fedprox", "mu": 1.0, "label": "prox1"}]
    summary = _run(_merge(tiny_run, IN_PROCESS), tmp_path)
    assert summary["methods"]["fedprox"]["clients"] == summary["methods"]["fedavg"]["clients"]
    assert summary["methods"]["prox1"]["clients"] != summary["methods"]["fedavg"]["clients"]


def test_missing_data_path_is_one_sentence(tiny_run, tmp_path):
    tiny_run["data"] = {"source": "fashion_mnist", "path": str(tmp_path / "missing"), "num_clients": 4}
    with pytest.raises(ConfigError, match=r"data\.path"):
        _run(tiny_run, tmp_path / "out")


def test_partition_that_leaves_a_client_empty_names_the_client(tiny_run, tmp_path):
    tiny_run["data"]["num_clients"] = 30
    tiny_run["data"]["partition"] = {"name": "shards", "classes_per_client": 1, "samples_per_client": 10}
    tiny_run["data"]["synthetic"]["num_samples"] = 40
    with pytest.raises(ConfigError, match=r"client \d+"):
        _run(tiny_run, tmp_path)


def test_existing_out_dir_is_never_overwritten(tiny_run, tmp_path):
    (tmp_path / "config.yaml").write_text("name: earlier\n")
    with pytest.raises(ConfigError, match="--resume"):
        Simulation(tiny_run, out_dir=tmp_path)
    assert (tmp_path / "config.yaml").read_text() == "name: earlier\n"


MULTIMODAL = {
    "name": "multimodal", "seed": 5,
    "data": {"source": "multimodal:vqa", "kind": "text_generation", "options": {"num_samples": 96},
             "num_clients": 4, "partition": {"name": "iid"}},
    "model": {"backbone": "tiny-pretrained:llava", "lora": {"rank": 2}},
    "federation": {"rounds": 2, "clients_per_round": 3, "eval_every": 2, "checkpoint_every": 1, "eval_round_zero": True},
    "train": {"local_steps": 2, "batch_size": 8, "lr": 0.003, "optimizer": "adam", "eval_batch_size": 32},
    "methods": ["fedavg"], "placement": {"clients_per_actor": 2, "cpus_per_actor": 0.5},
}


def test_a_multimodal_text_generation_run_keeps_packing_and_resume_invariance(tmp_path):
    """Image + question -> answer text on the tiny LLaVA: the same numbers on Ray actors of 2 clients as with 1 or 4
    clients per actor and after an interruption and --resume (those in this process: Ray's part of packing and
    resume is tested on the tiny ViT above)."""
    reference = _run(MULTIMODAL, tmp_path / "ref")
    fedavg = reference["methods"]["fedavg"]
    assert set(fedavg["mean"]) >= {"local_token_f1", "local_exact_match", "local_meteor", "local_perplexity"}
    in_process = _merge(MULTIMODAL, IN_PROCESS)
    packed = _run(_merge(in_process, {"placement": {"clients_per_actor": 1}}), tmp_path / "p1")
    assert _results(packed) == _results(reference)
    packed = _run(_merge(in_process, {"placement": {"clients_per_actor": 4}}), tmp_path / "p4")
    assert _results(packed) == _results(reference)

    def interrupt(sim, label, rounds_done):
        if rounds_done == 1:
            raise _Interrupt

    with pytest.raises(_Interrupt):
        _run(in_process, tmp_path / "cut", callbacks=[interrupt])
    assert _results(Simulation.resume(tmp_path / "cut", progress=False).run()) == _results(reference)
    events = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "eval"] == [0, 2]
