"""`rayfed bench` on a CPU-sized workload: it runs end to end and writes what the docs describe."""

from __future__ import annotations

import json

import pytest

from rayfed.benchmarks.overhead import IdealLoop, Workload, median_ratios, round_breakdown, run_bench
from rayfed.errors import ConfigError
from rayfed.seeding import sample_clients


@pytest.mark.usefixtures("ray_local")
def test_bench_writes_json_and_markdown_with_overhead_ratios(tmp_path):
    workload = Workload(num_clients=4, clients_per_round=2, local_steps=2, samples_per_client=16, rounds=3)
    results = run_bench(workload, (1, 2), tmp_path)

    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [run["actors_per_gpu"] for run in saved["runs"]] == [1, 2]
    assert [run["num_actors"] for run in saved["runs"]] == [1, 2]
    for run in results["runs"]:
        assert len(run["round_s"]) == len(run["ideal_round_s"]) == workload.rounds - 1  # the warm-up round is left out
        assert run["overhead_ratio"] == pytest.approx(run["mean_round_s"] / run["mean_ideal_round_s"])
        assert run["peak_host_mib_per_actor"] > 0
        assert [part["round"] for part in run["breakdown"]] == list(range(1, workload.rounds))
        for part, wall in zip(run["breakdown"], run["round_s"]):
            assert 0 < part["update_s"] < wall and part["actor_rest_s"] >= 0 and part["after_actors_s"] > 0
    # every packing trains the same clients with the same seeds
    assert results["runs"][0]["local_acc"] == results["runs"][1]["local_acc"]
    [memory] = saved["client_memory"]  # no GPU: host memory only
    assert memory["state_device"] == "cpu" and memory["state_bytes_per_client"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| 0 |") == 2 and "overhead ratio" in table


def test_a_round_splits_into_local_updates_the_rest_on_the_actors_and_the_time_around_them():
    # two actors: one trains 0.5 s of its 0.6 s call from t=10.1, the other 0.7 of 0.8 s from t=10.2
    actor_times = [[{"round": 0, "start": 10.1, "end": 10.7, "update_s": 0.5}],
                   [{"round": 0, "start": 10.2, "end": 11.0, "update_s": 0.7}]]
    [part] = round_breakdown([1.2], [11.1], actor_times)  # the round took 1.2 s and its callback ran at t=11.1
    assert part["update_s"] == 0.7
    assert part["actor_rest_s"] == pytest.approx(0.2)  # first start to last end is 0.9 s
    assert part["after_actors_s"] == pytest.approx(0.1) and part["before_actors_s"] == pytest.approx(0.2)


def test_each_packing_gets_the_median_of_its_ratios_over_the_repeats():
    runs = [{"num_gpus": 1, "actors_per_gpu": per_gpu, "overhead_ratio": ratio}
            for per_gpu, ratio in [(1, 1.3), (2, 0.9), (1, 1.0), (2, 0.8), (1, 1.1)]]
    runs.append({"num_gpus": 2, "actors_per_gpu": 1, "overhead_ratio": None})  # no 1-GPU ideal for 2 GPUs
    assert median_ratios(runs) == {"1x1": 1.1, "1x2": pytest.approx(0.85)}


def test_the_ideal_round_trains_the_round_s_sampled_clients_from_the_same_start(monkeypatch):
    workload = Workload(num_clients=6, clients_per_round=2, local_steps=1, samples_per_client=16)
    ideal = IdealLoop(workload)
    trained = []
    original_train = type(ideal.host._context(0, 0)).train

    def spy(context, params, **kwargs):
        trained.append((context.client_id, context.round, params is ideal.shared))
        return original_train(context, params, **kwargs)

    monkeypatch.setattr(type(ideal.host._context(0, 0)), "train", spy)
    assert ideal.run_round(3) > 0
    expected = sample_clients(ideal.config.seed, 3, workload.num_clients, workload.clients_per_round)
    assert len(expected) == 2
    assert trained == [(cid, 3, True) for cid in expected]


def test_bench_needs_at_least_one_repeat(tmp_path):
    with pytest.raises(ConfigError, match="--repeats 0"):
        run_bench(Workload(), (1,), tmp_path, repeats=0)
