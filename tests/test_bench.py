"""`rayfed bench` on a CPU-sized workload: it runs end to end and writes what the docs describe."""

from __future__ import annotations

import json

import pytest

from rayfed.benchmarks.overhead import Workload, run_bench


@pytest.mark.usefixtures("ray_local")
def test_bench_writes_json_and_markdown_with_overhead_ratios(tmp_path):
    workload = Workload(num_clients=4, clients_per_round=2, local_steps=2, samples_per_client=16, rounds=3)
    results = run_bench(workload, (1, 2), tmp_path)

    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [run["actors_per_gpu"] for run in saved["runs"]] == [1, 2]
    assert [run["num_actors"] for run in saved["runs"]] == [1, 2]
    assert len(saved["ideals"]) == 3  # before, between and after the two rayfed runs
    for run in results["runs"]:
        assert len(run["round_s"]) == workload.rounds - 1  # the warm-up round is left out
        assert run["overhead_ratio"] == pytest.approx(run["mean_round_s"] / run["ideal_round_s"])
        assert run["peak_host_mib_per_actor"] > 0
    # every packing trains the same clients with the same seeds
    assert results["runs"][0]["local_acc"] == results["runs"][1]["local_acc"]
    [memory] = saved["client_memory"]  # no GPU: host memory only
    assert memory["state_device"] == "cpu" and memory["state_bytes_per_client"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| 0 |") == 2 and "overhead ratio" in table
