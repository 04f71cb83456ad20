"""A rayfed run on a 3-node Ray cluster (``ray.cluster_utils.Cluster``, all nodes on this
machine): ClientActors follow ``placement.strategy``, and a worker node removed mid-run is
survived with the numbers of an undisturbed run, all results in the driver's run directory.

The cluster lives in a subprocess: it must not meet the session's local Ray (``ray_local``), and
``Cluster`` rewrites the machine's default Ray address, which a private ``RAY_TMPDIR`` confines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rayfed.simulation import Simulation

REPO = Path(__file__).resolve().parents[1]

CLUSTER_SCENARIOS = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    import ray
    from ray.cluster_utils import Cluster
    from rayfed.simulation import Simulation, keep_loopback

    config, root = json.loads(sys.argv[1]), Path(sys.argv[2])
    node_args = {"num_cpus": 1, "object_store_memory": 10**8, "node_ip_address": "127.0.0.1"}
    # A removed node is declared dead after ~1 s instead of Ray's default ~15 s.
    fast_health_checks = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 200,
                          "health_check_timeout_ms": 500, "health_check_failure_threshold": 3}
    with keep_loopback():  # every node's servers on 127.0.0.1 only
        cluster = Cluster(initialize_head=True, head_node_args={
            **node_args, "include_dashboard": False, "_system_config": fast_health_checks})
        workers = [cluster.add_node(**node_args) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)


    def where(actor):
        def ids(instance):
            context = ray.get_runtime_context()
            return context.get_node_id(), context.get_actor_id()
        return ray.get(actor.__ray_call__.remote(ids))


    facts = {"head": cluster.head_node.node_id, "workers": [w.node_id for w in workers],
             "node_addresses": sorted({node["NodeManagerAddress"] for node in ray.nodes()})}
    try:
        # After round 2 (checkpointed) a worker node hosting a ClientActor goes.
        facts["rounds"] = []
        def remove_a_client_node(sim, label, rounds_done):
            hosts = [where(a) for a in sim.actors]
            if rounds_done == 1:
                facts["spread_nodes"] = [n for n, _ in hosts]
            facts["rounds"].append({"round": rounds_done, "nodes": [n for n, _ in hosts],
                                    "actors": [a for _, a in hosts]})
            if rounds_done == 2 and "removed" not in facts:
                victim = next(w for w in workers if w.node_id in {n for n, _ in hosts})
                cluster.remove_node(victim, allow_graceful=False)
                facts["removed"] = victim.node_id
                deadline = time.monotonic() + 30
                while any(n["NodeID"] == victim.node_id and n["Alive"] for n in ray.nodes()):
                    assert time.monotonic() < deadline, "the removed node was never declared dead"
                    time.sleep(0.2)
        # Without the model check in the driver's process: the fixture's in-process reference run builds the model.
        facts["disturbed"] = Simulation(config, out_dir=root / "disturbed", callbacks=[remove_a_client_node],
                                        progress=False, check_model=False).run()
    finally:
        (root / "facts.json").write_text(json.dumps(facts))
        ray.shutdown()
        cluster.shutdown()
""")


@pytest.fixture(scope="module")
def cluster_runs(tmp_path_factory) -> dict:
    from conftest import TINY_RUN

    config = {
        **TINY_RUN,
        "federation": {**TINY_RUN["federation"], "checkpoint_every": 1},
        # Two ClientActors of 0.25 CPU: they fit on one 1-CPU node, so only SPREAD separates them,
        # and they fit on the two nodes left after one is removed.
        "placement": {**TINY_RUN["placement"], "strategy": "SPREAD", "clients_per_actor": 2,
                      "cpus_per_actor": 0.25},
    }
    root = tmp_path_factory.mktemp("cluster")
    # Ray's Unix socket paths must stay short: a private temp dir directly under /tmp.
    with tempfile.TemporaryDirectory(prefix="rf", dir="/tmp") as ray_tmp:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled")  # a throwaway local test cluster
        done = subprocess.run(
            [sys.executable, "-c", CLUSTER_SCENARIOS, json.dumps(config), str(root)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )
    facts_path = root / "facts.json"
    facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
    assert done.returncode == 0, f"{facts}\n{done.stderr[-4000:]}"
    # The undisturbed run's numbers, from the same actors in this process (the numbers of a run on Ray:
    # test_simulation's packing tests): the cluster runs only the run that loses a node.
    in_process = {**config, "placement": {**config["placement"], "executor": "local"}}
    reference = Simulation(in_process, out_dir=root / "reference", progress=False).run()
    return {**facts, "reference": reference, "root": root}


def _results(summary: dict) -> dict:
    return {"methods": summary["methods"], "comm_bytes": summary["comm_bytes"]}


def test_the_test_clusters_nodes_bind_to_loopback(cluster_runs):
    assert cluster_runs["node_addresses"] == ["127.0.0.1"]


def test_spread_places_client_actors_on_different_nodes(cluster_runs):
    # With the DEFAULT strategy Ray packs both actors of this config onto the driver's node
    # (checked by hand with Ray 2.60), so only SPREAD separates them.
    spread = cluster_runs["spread_nodes"]
    assert len(spread) == 2 and len(set(spread)) == 2, spread


def test_a_removed_node_is_survived_with_the_undisturbed_numbers(cluster_runs):
    removed = cluster_runs["removed"]
    assert removed in cluster_runs["workers"]
    rounds = cluster_runs["rounds"]
    assert [r["round"] for r in rounds] == [1, 2, 3, 4]
    before, after = rounds[1], rounds[2]
    assert removed in before["nodes"] and removed not in after["nodes"]
    assert set(after["actors"]).isdisjoint(before["actors"]), "the ClientActors were not replaced"
    assert _results(cluster_runs["disturbed"]) == _results(cluster_runs["reference"])


def test_all_results_land_in_the_drivers_run_dir(cluster_runs):
    run_dir = cluster_runs["root"] / "disturbed"
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "report.md", "results/fedavg.json"):
        assert (run_dir / name).is_file(), name
    assert json.loads((run_dir / "summary.json").read_text()) == cluster_runs["disturbed"]
    latest = json.loads((run_dir / "checkpoints" / "fedavg" / "latest.json").read_text())
    assert latest["round"] == 4
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["round"] for e in events if e["event"] == "round"] == [1, 2, 3, 4]
