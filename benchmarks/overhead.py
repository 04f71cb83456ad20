"""`rayfed bench`: rayfed's wall time per round against the ideal on the same device.

The ideal is one process running the same client training steps back to back with the same
model (no Ray, no actors, no aggregation): what a hand-written single-GPU loop would cost.
Each of its rounds runs right after rayfed's same round, in the bench process while rayfed's
actors wait, so both see the same host: on the lent GPU hosts the same loop drifts by tens of
percent within minutes, and an ideal timed before or after a whole run is no fair reference.
overhead ratio = rayfed's round wall time / the ideal's, over the same rounds (the first
round is a warm-up for both and is left out).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray
import torch

from rayfed.actors.client import ClientActor
from rayfed.config import RunConfig, load_config
from rayfed.errors import ConfigError
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.method import tensor_bytes
from rayfed.report import format_table
from rayfed.simulation import Simulation, init_local_ray
from rayfed.tasks import sample_round


@dataclass(frozen=True)
class Workload:
    """One fixed FL workload; the defaults are the CPU smoke size, `--gpu` the issue's CLIP size."""

    backbone: str = "tiny:vit"
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    image_size: int = 16
    num_clients: int = 20
    clients_per_round: int = 4
    local_steps: int = 5
    batch_size: int = 16
    samples_per_client: int = 32
    rounds: int = 3
    method: str = "fedavg"
    cuda_graphs: bool = False  # train.cuda_graphs: each actor replays one captured training step

    def config(
        self, clients_per_actor: int, gpus_per_actor: float, seed: int = 0, client_state: str = "auto",
    ) -> RunConfig:
        return load_config({
            "name": "bench",
            "seed": seed,
            "data": {
                "source": "synthetic",
                "synthetic": {"num_samples": self.num_clients * self.samples_per_client, "num_classes": 10,
                              "image_size": self.image_size, "channels": 3},
                "num_clients": self.num_clients,
                "partition": {"name": "iid"},
            },
            "model": {"backbone": self.backbone, "lora": {"rank": self.lora_rank, "alpha": self.lora_rank,
                                                          "targets": list(self.lora_targets)}},
            "federation": {"rounds": self.rounds, "clients_per_round": self.clients_per_round,
                           "eval_every": self.rounds + 1},
            "train": {"local_steps": self.local_steps, "batch_size": self.batch_size, "optimizer": "adam", "lr": 1e-3,
                      "cuda_graphs": self.cuda_graphs},
            "methods": [self.method],
            "placement": {"clients_per_actor": clients_per_actor, "cpus_per_actor": 1, "gpus_per_actor": gpus_per_actor,
                          "client_state": client_state},
        })


GPU_WORKLOAD = Workload(
    backbone="open_clip:ViT-B-16", lora_rank=16, lora_targets=("c_fc", "c_proj"), image_size=32,
    num_clients=100, clients_per_round=16, local_steps=10, batch_size=64, samples_per_client=64, rounds=6,
    cuda_graphs=True,
)


class IdealLoop:
    """The ideal: the same clients' training steps, round by round, back to back in this process."""

    def __init__(self, workload: Workload):
        self.config = workload.config(clients_per_actor=workload.num_clients, gpus_per_actor=0)
        self.host = ClientActor(self.config.to_dict(), list(range(workload.num_clients)))
        self.shared = self.host.start_method(0)

    def run_round(self, round_idx: int) -> float:
        """Seconds for round ``round_idx``'s sampled clients, each trained from the same shared parameters."""
        sampled = sample_round(self.config, round_idx)  # the clients rayfed's round trains
        _sync(self.host.device)
        started = time.perf_counter()
        for cid in sampled:
            self.host._context(cid, round_idx).train(self.shared)
        _sync(self.host.device)
        return time.perf_counter() - started


def measure_rayfed(workload: Workload, actors_per_gpu: int, num_gpus: int, ideal: IdealLoop) -> dict[str, Any]:
    """One rayfed run; after each of its rounds (outside the round's timing) ``ideal`` runs the same round."""
    devices = max(num_gpus, 1)
    num_actors = actors_per_gpu * devices
    config = workload.config(
        clients_per_actor=math.ceil(workload.num_clients / num_actors),
        gpus_per_actor=1 / actors_per_gpu if num_gpus else 0,
    )
    usage: list[dict] = []
    round_ends: list[float] = []
    round_times: list[list[dict[str, float]]] = []
    ideal_round_s: list[float] = []

    def after_round(sim: Simulation, label: str, rounds_done: int) -> None:
        round_ends.append(time.time())
        ideal_round_s.append(ideal.run_round(rounds_done - 1))
        if rounds_done == workload.rounds:
            usage.extend(ray.get([actor.resource_usage.remote() for actor in sim.actors]))
            round_times.extend(ray.get([actor.get_round_times.remote() for actor in sim.actors]))

    out_dir = Path(tempfile.mkdtemp(prefix=f"rayfed-bench-{actors_per_gpu}x{num_gpus}-")) / "run"
    started = time.perf_counter()
    summary = Simulation(config, out_dir=out_dir, callbacks=[after_round], progress=False).run()
    total = time.perf_counter() - started
    events = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    walls = [e["wall_s"] for e in events if e["event"] == "round"]
    breakdown = round_breakdown(walls, round_ends, round_times)[1:]
    busy = [e["actor_busy_s"] for e in events if e["event"] == "round"][1:]
    return {
        "actors_per_gpu": actors_per_gpu, "num_gpus": num_gpus, "num_actors": len(usage),
        "round_s": walls[1:], "ideal_round_s": ideal_round_s[1:], "total_s": total, "usage": usage, "breakdown": breakdown,
        **{f"mean_{key}": _mean([b[key] for b in breakdown]) for key in BREAKDOWN_KEYS},
        # the busiest actor's local updates against an even share of the round's (balanced rounds)
        "mean_busiest_actor_s": _mean([max(b) for b in busy]), "mean_even_share_s": _mean([sum(b) / num_actors for b in busy]),
        "local_acc": summary["methods"][workload.method]["mean"]["local_acc"],
    }


BREAKDOWN_KEYS = ("update_s", "actor_rest_s", "before_actors_s", "after_actors_s")


def round_breakdown(
    walls: list[float], round_ends: list[float], actor_times: list[list[dict[str, float]]],
) -> list[dict[str, float]]:
    """Where each round's wall time went: the clients' local updates (the longest of any actor); the
    rest of the actors' train_round calls beyond that (moves of states and uploads, the partial sum);
    before the first actor starts (payloads, Ray calls); after the last one ends (its uploads to the
    DriverActor, aggregation, logging). ``round_ends`` are wall-clock times taken by a round callback."""
    rounds = []
    for index, (wall, end) in enumerate(zip(walls, round_ends)):
        calls = [call for times in actor_times for call in times if call["round"] == index]
        first, last = min(c["start"] for c in calls), max(c["end"] for c in calls)
        update = max(c["update_s"] for c in calls)
        rounds.append({"round": index, "wall_s": wall, "update_s": update, "actor_rest_s": last - first - update,
                       "before_actors_s": wall - (last - first) - (end - last), "after_actors_s": end - last})
    return rounds


def memory_per_client(workload: Workload, client_state: str, num_clients: int = 16) -> dict[str, float]:
    """Memory each hosted client's own state adds (Ditto: a personal LoRA + head), next to its tensors' size.

    ``client_state="host"`` measures resident host memory, ``"device"`` allocated GPU memory.
    """
    sized = dataclasses.replace(workload, num_clients=num_clients, clients_per_round=4, method="ditto")
    config = sized.config(clients_per_actor=num_clients, gpus_per_actor=0, client_state=client_state)
    host = ClientActor(config.to_dict(), list(range(num_clients)))
    initial = host.start_method(0)
    payloads = {cid: initial for cid in range(num_clients)}
    host.train(0, [0], payloads)  # warm-up: allocator pools, optimizer code paths

    def used() -> int:
        gc.collect()
        if client_state == "device":
            return torch.cuda.memory_allocated(host.device)
        if hasattr(ctypes.CDLL(None), "malloc_trim"):  # glibc keeps freed heap resident; give it back first
            ctypes.CDLL(None).malloc_trim(0)
        return psutil.Process().memory_info().rss

    before = used()
    host.train(1, list(range(1, num_clients)), payloads)  # every client now holds tensors of its own
    added = used() - before
    return {"state_device": str(host.state_device), "bytes_per_client": added / (num_clients - 1),
            "state_bytes_per_client": tensor_bytes(host.states[1])}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(workload: Workload, actors_per_gpu: tuple[int, ...], out_dir: Path, repeats: int = 1) -> dict[str, Any]:
    """rayfed's runs for each packing (and, on a multi-GPU host, on 1 and all GPUs), each round paired with
    the ideal's same round (:func:`measure_rayfed`). With ``repeats`` > 1 the sweep runs that many times
    over, and ``median_ratios`` gives each one-GPU packing's median overhead ratio.
    """
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: the sweep runs at least once; pass an integer >= 1.")
    num_gpus = torch.cuda.device_count()
    owns_ray = not ray.is_initialized()
    ideal = IdealLoop(workload)
    results: dict[str, Any] = {
        "workload": dataclasses.asdict(workload),
        "machine": {"gpu": torch.cuda.get_device_name(0) if num_gpus else None, "num_gpus": num_gpus,
                    "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "ideal_device": str(ideal.host.device),
        "runs": [],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    # 1, 2, 4, ... GPUs up to all of them: the speed-up of each over one GPU
    gpu_counts = sorted({2**k for k in range(num_gpus.bit_length()) if 2**k <= num_gpus} | {num_gpus}) or [0]
    for gpus in gpu_counts:
        if num_gpus > 1 or not ray.is_initialized():
            # A Ray instance that sees `gpus` GPUs, so fractional actors cannot spread to the others.
            ray.shutdown()
            init_local_ray(object_store_memory=2 * 10**9, num_gpus=gpus)
        for repeat in range(repeats):
            for per_gpu in actors_per_gpu:
                result = measure_rayfed(workload, per_gpu, gpus, ideal)
                mean_round, ideal_round = _mean(result["round_s"]), _mean(result["ideal_round_s"])
                updates = workload.clients_per_round
                result.update(
                    repeat=repeat,
                    mean_round_s=mean_round,
                    mean_ideal_round_s=ideal_round,
                    overhead_ratio=mean_round / ideal_round if gpus <= 1 else None,
                    speedup_vs_ideal=ideal_round / mean_round,
                    client_updates_per_s=updates / mean_round,
                    samples_per_s=updates * workload.local_steps * workload.batch_size / mean_round,
                    peak_gpu_mib_per_actor=max(u["gpu_peak_bytes"] for u in result["usage"]) / 2**20,
                    peak_host_mib_per_actor=max(u["rss_bytes"] for u in result["usage"]) / 2**20,
                )
                results["runs"].append(result)
                atomic_write_json(out_dir / "bench.json", results)  # partial results survive a later failure
                print(f"[bench] {gpus} GPU(s) x {per_gpu} actors: {mean_round:.3f} s/round "
                      f"(ideal, paired rounds: {ideal_round:.3f}; local updates {result['mean_update_s']:.3f})", flush=True)
    if owns_ray or num_gpus > 1:
        ray.shutdown()
    del ideal
    results["median_ratios"] = median_ratios(results["runs"])
    add_speedups(results["runs"])
    results["client_memory"] = [memory_per_client(workload, "host")]
    if num_gpus:
        results["client_memory"].append(memory_per_client(workload, "device"))
    atomic_write_json(out_dir / "bench.json", results)
    atomic_write_text(out_dir / "bench.md", markdown(results))
    return results


def add_speedups(runs: list[dict[str, Any]]) -> None:
    """Each run's speed-up over the one-GPU run of the same actors per GPU (its first repeat)."""
    one_gpu = {}
    for run in runs:
        if run["num_gpus"] <= 1:
            one_gpu.setdefault(run["actors_per_gpu"], run["mean_round_s"])
    for run in runs:
        base = one_gpu.get(run["actors_per_gpu"])
        run["speedup_vs_1_gpu"] = None if base is None else base / run["mean_round_s"]


def median_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each packing's median overhead ratio over its runs, keyed "<GPUs>x<actors per GPU>"."""
    ratios: dict[str, list[float]] = {}
    for run in runs:
        if run["overhead_ratio"] is not None:
            ratios.setdefault(f"{run['num_gpus']}x{run['actors_per_gpu']}", []).append(run["overhead_ratio"])
    return {key: statistics.median(values) for key, values in ratios.items()}


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    rows = [[
        str(run["num_gpus"]), str(run["actors_per_gpu"]), f"{run['mean_round_s']:.3f}", f"{run['mean_ideal_round_s']:.3f}",
        "-" if run["overhead_ratio"] is None else f"{run['overhead_ratio']:.3f}", f"{run['speedup_vs_ideal']:.2f}",
        "-" if run.get("speedup_vs_1_gpu") is None else f"{run['speedup_vs_1_gpu']:.2f}",
        f"{run['client_updates_per_s']:.1f}", f"{run['samples_per_s']:.0f}",
        f"{run['peak_gpu_mib_per_actor']:.0f}", f"{run['peak_host_mib_per_actor']:.0f}",
        *(f"{run['mean_' + key]:.3f}" for key in BREAKDOWN_KEYS),
        f"{run['mean_busiest_actor_s']:.3f} / {run['mean_even_share_s']:.3f}",
    ] for run in results["runs"]]
    header = ["GPUs", "actors/GPU", "s/round", "ideal s/round", "overhead ratio", "x ideal speed", "x 1 GPU", "client updates/s",
              "samples/s", "peak GPU MiB/actor", "peak host MiB/actor",
              "local updates s", "rest on actor s", "before actors s", "after actors s", "busiest actor / even share s"]
    medians = ", ".join(f"{key}: {ratio:.3f}" for key, ratio in results["median_ratios"].items())
    return (
        f"Workload: `{json.dumps(results['workload'])}`\n\n"
        f"Machine: {machine['gpu'] or 'CPU only'}, {machine['cpus']} CPUs, torch {machine['torch']}\n\n"
        f"Ideal: one process running the same steps back to back on {results['ideal_device']}, each round right "
        "after rayfed's same round (paired rounds); the overhead ratio (one GPU) is rayfed's s/round over the "
        "ideal's, x ideal speed its inverse.\n\n"
        + format_table(rows, header)
        + "\nPer round (means over the timed rounds): the clients' local updates on the busiest actor, the rest "
        "of the actors' round calls, and the time before the first actor starts and after the last one ends.\n"
        + (f"\nMedian overhead ratio per GPUs x actors/GPU over the repeats: {medians}.\n" if medians else "")
        + "".join(
            f"\nMemory per hosted client (Ditto personal state kept on {memory['state_device']}): "
            f"{memory['bytes_per_client'] / 2**20:.2f} MiB for {memory['state_bytes_per_client'] / 2**20:.2f} MiB "
            "of tensors.\n"
            for memory in results["client_memory"]
        )
    )
