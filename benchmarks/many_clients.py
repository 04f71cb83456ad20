"""Round time and host memory against the number of clients: 100, 1,000 and 10,000 clients, 50 sampled per
round, on one host or on a local multi-node Ray cluster (``ray.cluster_utils``, every node on this machine).

    python -m rayfed.benchmarks.many_clients --clients 100 1000 10000 --nodes 3 --out runs/many_clients
    python -m rayfed.benchmarks.many_clients --workload gpu --clients 100 1000 10000 --out runs/many_clients_gpu

Each client count is one Ditto run (every client keeps a personal LoRA of its own, so hosted state grows with
the clients; with ``--method fedavg`` clients keep no state and only their data grows) on ``--actors``
ClientActors. Reported per count: the rounds' wall time (the first left out: it builds optimizers), and the host
memory of the run after its last round, as proportional set size (PSS) summed over this process, the
DriverActor and the ClientActors (and per process, ``pss_by_process``): pages of the object store that several
actors map, such as the clients' data the driver built once, count once. (Ray's own daemons and idle workers are
left out: their number varies between runs, not with the clients.) ``many_clients.md`` puts the memory growth per
added client beside what each client owns (its state and its encoded data) and ``many_clients.png`` plots both
against the number of clients.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from rayfed.benchmarks.overhead import GPU_WORKLOAD, Workload
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.results.report import format_table
from rayfed.simulation import Simulation, init_local_ray, keep_loopback

CPU_WORKLOAD = Workload(image_size=8, samples_per_client=16, local_steps=5, batch_size=8, lora_rank=4, rounds=5,
                        client_memory=False)
# The bench's ViT-B/16 clients with 2 local steps instead of 10 and 4 rounds instead of 6: what grows with the
# number of clients is the work around the steps, and 10 steps of 50 Ditto clients would take 25 s a round. 64
# samples a client (steps of the 48 training ones), as measured in benchmarks/README.md: 10,000 clients' raw
# images are then 7.5 GB.
WORKLOADS = {"cpu": CPU_WORKLOAD,
             "gpu": dataclasses.replace(GPU_WORKLOAD, client_memory=False, local_steps=2, rounds=4,
                                        samples_per_client=64)}


class _Measured(Exception):
    """Raised after the last round's measurement: it stops the run before its final evaluation."""


def pss_bytes(pids: list[int]) -> int:
    """Proportional set size of these processes (pages they share, such as the object store's, split between them)."""
    return sum(psutil.Process(pid).memory_full_info().pss for pid in pids)


def measure(workload: Workload, num_clients: int, num_actors: int, gpus_per_actor: float, per_round: int,
            method: str = "ditto", client_state: str = "auto") -> dict:
    sized = dataclasses.replace(workload, num_clients=num_clients, clients_per_round=per_round, method=method)
    config = sized.config(clients_per_actor=math.ceil(num_clients / num_actors), gpus_per_actor=gpus_per_actor,
                          client_state=client_state)
    found: dict[str, Any] = {}

    def after_round(sim: Simulation, label: str, rounds_done: int) -> None:
        if rounds_done == sized.rounds:  # before the final evaluation
            usage = ray.get([actor.resource_usage.remote() for actor in sim.actors])
            actors = [*sim.actors, sim.driver]
            pids = ray.get([actor.__ray_call__.remote(lambda instance: os.getpid()) for actor in actors])
            found["pss_bytes"] = pss_bytes([os.getpid(), *pids])
            found["pss_by_process"] = {"this process": pss_bytes([os.getpid()]), "DriverActor": pss_bytes(pids[-1:]),
                                       "ClientActors": pss_bytes(pids[:-1])}
            found["state_bytes"] = sum(u["state_bytes"] for u in usage)
            found["data_bytes"] = sum(u["data_bytes"] for u in usage)
            found["dataset_bytes"] = sum(array.nbytes for holding in sim.federation.holdings
                                         for array in vars(holding.dataset).values() if hasattr(array, "nbytes"))
            raise _Measured  # the final evaluation of every client is not what this measures

    out_dir = Path(tempfile.mkdtemp(prefix=f"rayfed-many-{num_clients}-")) / "run"
    started = time.perf_counter()
    with contextlib.suppress(_Measured):
        Simulation(config, out_dir=out_dir, callbacks=[after_round], progress=False, check_model=False).run()
    events = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    rounds = [e for e in events if e["event"] == "round"][1:]
    walls = [e["wall_s"] for e in rounds]
    return {"clients": num_clients, "actors": num_actors, "round_s": walls, "median_round_s": statistics.median(walls),
            "busiest_actor_s": [max(e["actor_busy_s"]) for e in rounds],
            "total_s": time.perf_counter() - started, **found}


def start_cluster(nodes: int, cpus_per_node: int, gpus: int) -> Any:
    """Local Ray on 127.0.0.1: one node, or ``nodes`` nodes of ``cpus_per_node`` CPUs each (``ray.cluster_utils``)."""
    if nodes == 1:
        init_local_ray(num_cpus=cpus_per_node, num_gpus=gpus, object_store_memory=4 * 10**9)
        return None
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": cpus_per_node, "object_store_memory": 10**9, "node_ip_address": "127.0.0.1"}
    with keep_loopback():
        cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
        for _ in range(nodes - 1):
            cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def memory_rows(results: list[dict]) -> list[list[str]]:
    """Each count's memory, and its growth per added client against the first count, beside what a client owns."""
    base = results[0]
    rows = []
    for result in results:
        owned = (result["state_bytes"] + result["data_bytes"]) / result["clients"]
        added = result["clients"] - base["clients"]
        growth = (result["pss_bytes"] - base["pss_bytes"]) / added if added else float("nan")
        rows.append([str(result["clients"]), f"{result['median_round_s']:.3f}",
                     f"{result['median_round_s'] / base['median_round_s']:.2f}", f"{result['pss_bytes'] / 2**20:,.0f}",
                     f"{growth / 2**10:,.1f}" if added else "-", f"{owned / 2**10:,.1f}",
                     f"{result['dataset_bytes'] / 2**20:,.1f}", f"{result['total_s']:.0f}"])
    return rows


HEADER = ["clients", "s/round (median)", "x first", "host PSS MiB", "KiB per added client", "KiB a client owns",
          "dataset MiB (once per node)", "run s (to the last round)"]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients = [r["clients"] for r in results]
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(clients, [r["median_round_s"] for r in results], marker="o")
    left.set(xscale="log", xlabel="clients", ylabel="s / round (50 sampled)", ylim=(0, None))
    right.plot(clients, [r["pss_bytes"] / 2**30 for r in results], marker="o", label="host memory (PSS)")
    right.plot(clients, [(r["state_bytes"] + r["data_bytes"]) / 2**30 for r in results], marker="s",
               label="clients' state + data")
    right.set(xscale="log", yscale="log", xlabel="clients", ylabel="GiB")
    right.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="cpu")
    parser.add_argument("--clients", nargs="+", type=int, default=[100, 1000, 10000])
    parser.add_argument("--per-round", type=int, default=50)
    parser.add_argument("--nodes", type=int, default=1, help="more than 1: a local ray.cluster_utils cluster")
    parser.add_argument("--cpus-per-node", type=int, default=2)
    parser.add_argument("--actors", type=int, default=None, help="ClientActors (default: one per GPU, else per node)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds a run (default: the workload's; the first "
                        "is left out of the round times)")
    parser.add_argument("--method", default="ditto",
                        help="ditto: every client keeps a personal LoRA; fedavg: clients keep no state of their own")
    parser.add_argument("--client-state", choices=["auto", "host", "device"], default="auto",
                        help="placement.client_state: where clients' states live between rounds")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    import torch

    workload = WORKLOADS[args.workload]
    if args.rounds is not None:
        workload = dataclasses.replace(workload, rounds=args.rounds)
    gpus = torch.cuda.device_count() if args.workload == "gpu" else 0
    num_actors = args.actors or max(gpus, args.nodes)
    cluster = start_cluster(args.nodes, args.cpus_per_node, gpus)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for num_clients in args.clients:
            result = measure(workload, num_clients, num_actors, 1.0 if gpus else 0, args.per_round,
                             args.method, args.client_state)
            results.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "round_s"}), flush=True)
            atomic_write_json(out / "many_clients.json", {
                "workload": {**dataclasses.asdict(workload), "method": args.method, "client_state": args.client_state},
                "nodes": args.nodes,
                "cpus_per_node": args.cpus_per_node, "gpu": torch.cuda.get_device_name(0) if gpus else None,
                "results": results})
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    atomic_write_text(out / "many_clients.md", format_table(memory_rows(results), HEADER))
    plot(results, out / "many_clients.png")


if __name__ == "__main__":
    main()
