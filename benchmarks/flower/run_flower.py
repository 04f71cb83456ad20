"""Time one Flower variant on rayfed's benchmark workload; write OUT/flower_<variant>.json.

    python benchmarks/flower/run_flower.py --variant documented|cached --workload cpu|gpu|llm|llm-cpu --out DIR

Runs the flowerbench ServerApp and ClientApp in Flower's Simulation Engine (Ray backend) through
`flwr.simulation.run_simulation`, with one supernode per client and `client_resources` chosen so
that as many ClientApp actors run as rayfed's bench uses (`--actors`, default 1 per GPU, or 1 on
a CPU-only host). Seconds per round come from the ServerApp's evaluate_fn timestamps; the first
round (actor start-up, first-touch) is a warm-up and left out, as in `rayfed bench`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # flowerbench; Flower passes sys.path on to its Ray workers

VARIANTS = {"documented": "flowerbench.client_app", "cached": "flowerbench.client_app_cached"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    parser.add_argument("--workload", default="cpu",
                        help="a name of `rayfed bench --workload` (rayfed.benchmarks.overhead's WORKLOADS)")
    parser.add_argument("--rounds", type=int, default=None, help="override the workload's rounds (first is warm-up)")
    parser.add_argument("--actors", type=int, default=1, help="ClientApp actors per GPU (CPU-only: in all)")
    parser.add_argument("--client-cpus", type=float, default=1, help="client_resources num_cpus (rayfed: 1 per actor)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import importlib

    import flwr
    import ray
    import torch
    from flowerbench import server_app, task
    from flwr.simulation import run_simulation
    from rayfed.benchmarks.overhead import workload_named

    workload = workload_named(args.workload)
    if args.rounds:
        workload = dataclasses.replace(workload, rounds=args.rounds)
    if args.variant == "documented":  # the docs' plain PyTorch loop; a graph captured per message would only add
        workload = dataclasses.replace(workload, cuda_graphs=False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = out / f"flower_{args.variant}.rounds.jsonl"
    progress.unlink(missing_ok=True)
    os.environ[task.WORKLOAD_ENV] = task.workload_spec(workload)  # inherited by the Ray workers
    os.environ[server_app.PROGRESS_ENV] = str(progress)

    num_gpus = torch.cuda.device_count()
    if num_gpus:
        client_resources = {"num_cpus": args.client_cpus, "num_gpus": 1 / args.actors}
        init_args: dict = {}
        num_actors = min(int((os.cpu_count() or 1) / args.client_cpus), args.actors * num_gpus)
    else:  # CPU only: a Ray cluster of exactly `actors` client slots
        client_resources = {"num_cpus": args.client_cpus, "num_gpus": 0.0}
        init_args = {"num_cpus": int(args.actors * args.client_cpus)}
        num_actors = args.actors
    init_args.update(address="local", _node_ip_address="127.0.0.1", object_store_memory=2 * 10**9,
                     log_to_driver=False)
    client_app = importlib.import_module(VARIANTS[args.variant]).app

    print(f"[flower] {args.variant}: flwr {flwr.__version__}, ray {ray.__version__}, {workload.num_clients} "
          f"supernodes, {workload.clients_per_round}/round, {workload.rounds} rounds, client_resources "
          f"{client_resources}", flush=True)
    started = time.perf_counter()
    run_simulation(
        server_app=server_app.app,
        client_app=client_app,
        num_supernodes=workload.num_clients,
        backend_config={"client_resources": client_resources, "init_args": init_args},
    )
    total = time.perf_counter() - started

    marks = server_app.ROUND_MARKS
    all_rounds = [b - a for a, b in itertools.pairwise(marks)]
    metrics = server_app.TRAIN_METRICS
    if len(all_rounds) != workload.rounds or len(metrics) != workload.rounds:
        print(f"[flower] {args.variant}: the run did not finish: {len(all_rounds)} of {workload.rounds} rounds "
              f"timed, train metrics for {len(metrics)}", file=sys.stderr)
        return 1
    round_s = all_rounds[1:]
    mean_round = sum(round_s) / len(round_s)
    result = {
        "framework": "flower", "variant": args.variant,
        "versions": {"flwr": flwr.__version__, "ray": ray.__version__, "torch": torch.__version__},
        "machine": {"gpu": torch.cuda.get_device_name(0) if num_gpus else None, "num_gpus": num_gpus,
                    "cpus": os.cpu_count(), "python": platform.python_version()},
        "workload": dataclasses.asdict(workload),
        "client_resources": client_resources, "num_actors": num_actors,
        "round_s": round_s, "warmup_round_s": all_rounds[0], "mean_round_s": mean_round, "total_s": total,
        "client_updates_per_s": workload.clients_per_round / mean_round,
        "samples_per_s": workload.clients_per_round * workload.local_steps * workload.batch_size / mean_round,
        "peak_gpu_mib_per_actor": max(m["gpu-peak-bytes"] for m in metrics.values()) / 2**20,
        "peak_host_mib_per_actor": max(m["rss-bytes"] for m in metrics.values()) / 2**20,
        "train_loss": {str(rnd): m["train_loss"] for rnd, m in sorted(metrics.items())},
    }
    (out / f"flower_{args.variant}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"[flower] {args.variant}: {mean_round:.3f} s/round over rounds 2..{workload.rounds} "
          f"(warm-up {all_rounds[0]:.3f} s, total {total:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
