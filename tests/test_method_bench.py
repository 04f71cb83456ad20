"""`rayfed bench --workload <seed paper>`: a method's rounds paired with the same method in one plain process."""

from __future__ import annotations

import json

import pytest

from rayfed.benchmarks.method_bench import (
    METHOD_WORKLOADS, MethodLoop, MethodWorkload, reference_config, round_timeline, run_method_bench, update_flops,
    workload_config,
)
from rayfed.errors import ConfigError
from rayfed.method import Method

QUICK = MethodWorkload("configs/quickstart.yaml", "ditto", "configs/quickstart.yaml", "ditto")


def test_the_ideal_trains_rayfeds_clients_each_round_and_the_table_holds_both_runs(tmp_path):
    results = run_method_bench(QUICK, tmp_path, rounds=2, overrides=(
        "placement.executor=local", "data.num_clients=8", "federation.clients_per_round=4", "train.local_steps=4"))
    method, reference = results["method"], results["reference"]
    for run in (method, reference):
        assert run["interleaved"] and "ideal_released" not in run
        assert [r["clients"] for r in run["ideal_rounds"]] == run["participants"]
        assert all(len(clients) == 4 for clients in run["participants"])
        assert run["update_profile"]["flops"] > 0 and run["ideal_evaluation_s"] > 0
    # Ditto trains its personal model beside the global one: more FLOPs an update than LoRA FedAvg's
    assert method["update_profile"]["flops"] > reference["update_profile"]["flops"]
    assert results["tflops_ratio"] == pytest.approx(method["tflops_per_s"] / reference["tflops_per_s"])
    assert method["label"] == "ditto" and reference["label"] == "fedavg"
    for timeline in method["timelines"]:  # in one process each call runs when it is made, one after another
        [started], [updated], [ended] = (timeline[f"actors_{when}_at"] for when in ("started", "updated", "ended"))
        assert timeline["payloads_done_at"] <= started < updated <= ended <= timeline["aggregation_at"]
        assert timeline["aggregation_at"] < timeline["aggregation_done_at"] < timeline["wall_s"]
        assert timeline["store_s"] == 0 and timeline["aggregate_s"] > 0  # Ditto's mean; no mixture rows
    assert [t["round"] for t in method["timelines"]] == [1, 2]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["method"]["participants"] == method["participants"]
    table = (tmp_path / "bench.md").read_text()
    assert "| ditto |" in table and "| LoRA FedAvg |" in table and "a plain LoRA FedAvg step's" in table
    assert "in seconds from each round's start" in table and table.count("\n| 2 |") == 1


def test_a_round_timeline_places_the_server_calls_of_its_own_round_only():
    actor_times = [[{"round": 0, "start": 10.5, "updated": 12.0, "end": 12.5, "update_s": 1.4}],
                   [{"round": 0, "start": 10.7, "updated": 11.8, "end": 12.2, "update_s": 1.0},
                    {"round": 1, "start": 20.0, "updated": 21.0, "end": 21.5, "update_s": 1.0}]]
    server_times = [{"call": "payloads", "start": 9.98, "end": 10.4},  # began before the round's estimated start
                    {"call": "payloads", "start": 10.4, "end": 10.5},
                    {"call": "aggregate", "start": 13.0, "fetch_s": 0.1, "store_s": 0.5, "aggregate_s": 0.2,
                     "end": 13.8},
                    {"call": "payloads", "start": 19.0, "end": 19.5},  # the next round's
                    {"call": "aggregate", "start": 22.0, "end": 22.1}]
    timeline = round_timeline(10.0, 14.0, 9.0, actor_times, server_times, 0)
    assert timeline["payloads_s"] == pytest.approx(0.52) and timeline["payloads_done_at"] == pytest.approx(0.5)
    assert timeline["actors_started_at"] == [0.5, 0.7] and timeline["actors_ended_at"] == [2.2, 2.5]
    assert timeline["busiest_update_s"] == 1.4 and timeline["aggregation_at"] == 3.0
    assert timeline["store_s"] == pytest.approx(0.5) and timeline["aggregate_s"] == pytest.approx(0.2)
    assert timeline["fetch_s"] == pytest.approx(0.1)
    assert timeline["aggregation_done_at"] == pytest.approx(3.8) and timeline["wall_s"] == 4.0


def test_with_the_ideal_apart_its_rounds_all_run_first_and_its_models_are_gone_before_rayfeds_run(tmp_path,
                                                                                                    monkeypatch):
    from rayfed.benchmarks import method_bench

    order, models = [], []
    run_round, run, weak_models = method_bench.MethodLoop.run_round, method_bench.Simulation.run, MethodLoop.models

    def ideal_round(loop, round_idx):
        order.append(("ideal", round_idx))
        return run_round(loop, round_idx)

    def rayfed_run(sim):
        order.append(("rayfed", [model() is None for model in models]))
        return run(sim)

    def kept_models(loop):
        models.extend(weak_models(loop))
        return models

    monkeypatch.setattr(method_bench.MethodLoop, "run_round", ideal_round)
    monkeypatch.setattr(method_bench.MethodLoop, "models", kept_models)
    monkeypatch.setattr(method_bench.Simulation, "run", rayfed_run)
    results = run_method_bench(QUICK, tmp_path, rounds=2, smoke=True, reference=False, ideal_apart=True, overrides=(
        "placement.executor=local", "data.num_clients=8", "federation.clients_per_round=4", "train.local_steps=2"))
    assert order == [("ideal", 0), ("ideal", 1), ("rayfed", [True, True])]  # backbone and model released first
    method = results["method"]
    assert not method["interleaved"] and method["ideal_released"]
    assert [r["clients"] for r in method["ideal_rounds"]] == method["participants"]
    assert len(method["round_s"]) == 2 and method["overhead_ratio"] > 0 and method["ideal_evaluation_s"] > 0
    assert "reference" not in results
    assert json.loads((tmp_path / "bench.json").read_text())["workload"]["ideal_apart"]
    assert "The rounds were not interleaved" in (tmp_path / "bench.md").read_text()


def test_with_the_ideal_only_no_rayfed_run_starts_and_both_runs_give_their_update_rate(tmp_path, monkeypatch):
    from rayfed.benchmarks import method_bench

    def no_rayfed_run(sim):
        raise AssertionError("--ideal-only started rayfed's run")

    def every_client_first(method, round_idx, sampled, num_clients):  # as pFedMMA's first round
        return list(range(num_clients)) if round_idx == 0 else sampled

    monkeypatch.setattr(method_bench.Simulation, "run", no_rayfed_run)
    monkeypatch.setattr(Method, "participants", every_client_first)
    results = run_method_bench(QUICK, tmp_path, rounds=3, ideal_only=True, overrides=(
        "placement.executor=local", "data.num_clients=8", "federation.clients_per_round=4", "train.local_steps=2"))
    method, reference = results["method"], results["reference"]
    for run in (method, reference):
        assert run["ideal_only"] and run["ideal_released"]
        assert [len(r["clients"]) for r in run["ideal_rounds"]] == [8, 4, 4]
        assert run["mean_ideal_update_s"] == pytest.approx(sum(r["update_s"] for r in run["ideal_rounds"][1:]) / 2)
        # the rate of the timed rounds: their 4 clients' updates, not the first round's 8
        assert run["clients_per_round"] == 4 and run["tflops_per_s"] == pytest.approx(
            run["update_profile"]["flops"] * 4 / run["mean_ideal_update_s"] / 1e12)
    assert results["tflops_ratio"] == pytest.approx(method["tflops_per_s"] / reference["tflops_per_s"])
    table = (tmp_path / "bench.md").read_text()
    assert "Only the ideal ran" in table and "| ditto | - | " in table and "a plain LoRA FedAvg step's" in table
    with pytest.raises(ConfigError, match="--ideal-only .*--ideal-apart"):
        run_method_bench(QUICK, tmp_path, ideal_only=True, ideal_apart=True)


def test_the_profile_mode_profiles_one_steady_update_and_the_table_gets_mfu_and_the_time_to_result(tmp_path):
    results = run_method_bench(QUICK, tmp_path, rounds=2, ideal_only=True, reference=False, profile=True, overrides=(
        "placement.executor=local", "data.num_clients=8", "federation.clients_per_round=4", "train.local_steps=2"))
    method = results["method"]
    assert results["machine"]["bf16_peak_tflops"] is None and method["mfu"] is None  # a CPU: no peak, no guess
    profiled = method["profiled_update"]
    assert profiled["round"] == 2 and profiled["client"] in method["ideal_rounds"][1]["clients"]
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert profile["cpu_families"]["gemm"]["count"] > 0 and profile["missing_phases"] == []
    assert profile["host"]["phases_s"]["batch building"] > 0  # the engine's batch building ran inside the ranges
    estimate = results["time_to_result"]  # the quickstart's schedule: 15 rounds of 10 clients x 10 steps
    assert estimate["schedule"]["rounds"] == 15 and (estimate["paper_steps"], estimate["bench_steps"]) == (10, 2)
    scale = 10 / 2 * 10 / 4  # steps, clients a round: the measured round's 4 clients at 2 steps
    assert estimate["schedule_s"] == pytest.approx(
        15 * (method["mean_ideal_round_s"] + (scale - 1) * method["mean_ideal_update_s"]))
    assert not estimate["evaluations_included"] and "sweep" not in estimate
    first, later = method["ideal_rounds"]  # the first round's updates beyond the second's rate a client
    per_client = later["update_s"] / len(later["clients"])
    setup = method["first_round_setup"]
    assert setup["setup_s"] == pytest.approx(first["update_s"] - per_client * len(first["clients"]))
    assert setup["share_of_run"] == pytest.approx(setup["setup_s"] / (setup["setup_s"] + 20 * later["round_s"]))
    table = (tmp_path / "bench.md").read_text()
    assert "| MFU |" in table and "MFU is blank: no GPU" in table and "Time to result" in table
    assert "profile/profile.md" in table and "First round's setup" in table


def test_the_update_flops_extrapolated_from_one_and_two_steps_are_those_counted_over_the_whole_update():
    config = workload_config(QUICK, rounds=1, overrides=(
        "placement.executor=local", "data.num_clients=4", "federation.clients_per_round=2", "train.local_steps=5"))
    ideal = MethodLoop(config)
    [host] = ideal.hosts.values()
    payloads = ideal.driver.payloads([0], False)
    counted = host.local_update_flops(0, payloads)
    assert update_flops(host, 0, payloads, steps=5) == pytest.approx(counted, rel=1e-9)
    assert update_flops(host, 0, payloads, steps=9) > counted
    assert host.train_config.local_steps == 5


def test_the_reference_is_lora_fedavg_on_the_same_backbone_and_batch():
    config = workload_config(QUICK, rounds=2)
    reference = reference_config(config)
    assert [m.name for m in reference.methods] == ["fedavg"] and reference.model.module == "lora"
    assert reference.model.backbone == config.model.backbone and reference.model.lora == config.model.lora
    assert reference.train.batch_size == config.train.batch_size
    assert [m.label for m in config.methods] == ["ditto"] and config.federation.eval_every == 3
    tap = workload_config(METHOD_WORKLOADS["tap"], rounds=2, smoke=True)  # TAP's model: model.client: mome
    tap_reference = reference_config(tap)
    assert [m.name for m in tap_reference.methods] == ["fedavg"] and tap_reference.model.client == "mome"
    assert tap_reference.model.client_options == tap.model.client_options


@pytest.mark.parametrize("name", sorted(METHOD_WORKLOADS))
def test_every_seed_method_workload_validates_at_paper_size_and_smoke_size(name):
    workload = METHOD_WORKLOADS[name]
    for smoke, label in ((False, workload.label), (True, workload.smoke_label)):
        config = workload_config(workload, rounds=2, smoke=smoke)
        assert [m.label for m in config.methods] == [label] and config.federation.rounds == 2


def test_an_unknown_workload_and_a_missing_label_say_what_is_allowed(tmp_path):
    with pytest.raises(ConfigError, match=r"--workload = 'fedmosiac' is not known \(did you mean 'fedmosaic'\?\)"):
        run_method_bench("fedmosiac", tmp_path)
    with pytest.raises(ConfigError, match=r"no method is labelled 'nope'"):
        workload_config(MethodWorkload("configs/quickstart.yaml", "nope", "configs/quickstart.yaml", "nope"), 2)


def test_each_gpu_count_gets_a_ray_instance_of_that_many_gpus_spread_over_the_actors_and_the_same_numbers(tmp_path):
    from conftest import ray_paused
    from rayfed.benchmarks.gpu_scaling import run_gpu_scaling

    with ray_paused():  # each count starts its own Ray
        results = run_gpu_scaling(QUICK, tmp_path, [2, 1], rounds=2, overrides=(
            "data.num_clients=4", "federation.clients_per_round=2", "train.local_steps=2",
            "placement.clients_per_actor=2", "placement.cpus_per_actor=1", "ray.num_cpus=2"))
    scaling = results["scaling"]
    one, two = scaling["runs"]  # in increasing order
    assert (one["gpus"], two["gpus"]) == (1, 2) and one["actors"] == two["actors"] == 2
    # two actors share one GPU, or take one each; the Ray instance saw the count and the actors held their shares
    assert (one["gpus_per_actor"], two["gpus_per_actor"]) == ({"": 0.5}, {"": 1.0})
    assert (one["cluster_gpus"], one["actor_gpus"], two["cluster_gpus"], two["actor_gpus"]) == (1, 1, 2, 2)
    assert one["speedup"] == 1 and two["speedup"] == pytest.approx(one["mean_round_s"] / two["mean_round_s"])
    assert one["mean_round_s"] == one["round_s"][1] and len(two["timelines"]) == 2
    assert scaling["same_metrics"] and one["metrics"] == two["metrics"] and one["metrics"]["local_acc"] > 0
    assert scaling["logical_gpus"] and results["workload"]["gpu_counts"] == [2, 1]
    table = (tmp_path / "bench.md").read_text()
    assert "| 2 | 2 | 1.0 |" in table and "Ray's logical GPUs" in table and table.count("in seconds from each") == 2


def test_gpu_counts_a_host_cannot_give_or_a_run_without_its_own_ray_are_refused(tmp_path, monkeypatch, capsys):
    from rayfed.benchmarks.gpu_scaling import check_gpu_counts, spread_share
    from rayfed.cli import main
    from rayfed.simulation.placement import gpus_holding

    ray_started = False  # the session's Ray (ray_local) may be up: each check but one sees none
    monkeypatch.setattr("ray.is_initialized", lambda: ray_started)
    config = workload_config(QUICK, rounds=2, overrides=("data.num_clients=8", "federation.clients_per_round=4",
                                                        "placement.clients_per_actor=2"))
    assert check_gpu_counts(config, [4, 1, 4]) == [1, 4]
    # Ray keeps a share below 1 on one GPU: 4 actors at 0.75 (3 / 4) would leave the fourth waiting for a fourth GPU
    assert [spread_share(config, gpus) for gpus in (1, 3, 4, 8)] == [0.25, 0.5, 1.0, 1.0]
    assert all(gpus_holding([spread_share(config, gpus)] * 4) <= gpus for gpus in range(1, 9))
    with pytest.raises(ConfigError, match=r"--gpu-counts must be GPU counts >= 1"):
        check_gpu_counts(config, [0, 1])
    local = workload_config(QUICK, rounds=2, overrides=("placement.executor=local",))
    with pytest.raises(ConfigError, match=r"needs placement.executor: ray, no ray.address .*got executor 'local'"):
        check_gpu_counts(local, [1])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ConfigError, match=r"got executor 'ray', address '10.0.0.1:6379'"):
        check_gpu_counts(config, [1])
    monkeypatch.delenv("RAY_ADDRESS")
    ray_started = True  # a Ray this process started: its GPUs are not the count's
    with pytest.raises(ConfigError, match=r"no Ray already started in this process; got executor 'ray', address "
                                          r"None, Ray started"):
        check_gpu_counts(config, [1])
    ray_started = False
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"asks for 4 GPUs but this host has 2; give counts from 1 to 2"):
        check_gpu_counts(config, [1, 4])
    for flags, refusal in ((["--workload", "gpu"], "is for a seed method's workload"),
                           (["--workload", "fedmosaic", "--ideal-only"], "runs no ideal")):
        assert main(["bench", *flags, "--gpu-counts", "1", "2", "--out", str(tmp_path)]) == 2
        assert refusal in capsys.readouterr().err
