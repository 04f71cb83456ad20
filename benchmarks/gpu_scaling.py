"""`rayfed bench --workload <paper> --gpu-counts 1 4`: rayfed's run of a seed method on each count of a host's GPUs,
for the speed-up over the first count (issue 34's goal: FedMosaic's mixed-size clients >= 3.5x faster on 4 GPUs than
on one). No ideal runs beside it: what is compared is rayfed with itself.

Each count gets a fresh local Ray instance that sees that many GPUs (``ray.num_gpus``), so actors cannot spread to
the others. Each actor asks for the share that spreads the run's actors over those GPUs, ``1 / ceil(actors / GPUs)``,
unless ``--set placement.gpus_per_actor=...`` gives one for every count (a number, or ``measured``: probed at each
count); an architecture with a ``gpus_per_actor`` of its own keeps it. With ``placement.balance_by: cost`` and equal
shares each actor carries about the same cost (parameters x steps). Every count trains the same clients the same way,
so the metrics must agree (``same_metrics``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
import torch

from rayfed.architectures import actor_clients, architecture_names, gpu_share
from rayfed.benchmarks.method_bench import (
    MethodWorkload, header_markdown, rayfed_run, resolved_workload, results_header, timeline_markdown, workload_config,
)
from rayfed.config import RunConfig, load_config
from rayfed.errors import ConfigError
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.results.report import format_table
from rayfed.simulation.placement import even_gpu_share


def spread_share(config: RunConfig, gpus: int) -> float:
    """The GPU share of each of ``config``'s ClientActors that spreads them over ``gpus`` GPUs: the largest equal
    share that fits (Ray keeps a share below 1 on one GPU)."""
    return even_gpu_share(len(actor_clients(config)), gpus)


def check_gpu_counts(config: RunConfig, gpu_counts: Sequence[int]) -> list[int]:
    """The counts in increasing order, each once; a count this host cannot give, or a run that would not start its
    own Ray instance, is refused in one sentence."""
    if not gpu_counts or min(gpu_counts) < 1:
        raise ConfigError(f"--gpu-counts must be GPU counts >= 1, e.g. 1 4; got {list(gpu_counts)}.")
    address = config.ray.address or os.environ.get("RAY_ADDRESS")
    if config.placement.executor != "ray" or address or ray.is_initialized():
        raise ConfigError("--gpu-counts starts a local Ray instance for each count, so it needs placement.executor: "
                          "ray, no ray.address or RAY_ADDRESS, and no Ray already started in this process; got "
                          f"executor {config.placement.executor!r}, address {address!r}"
                          f"{', Ray started' if ray.is_initialized() else ''}.")
    present = torch.cuda.device_count()
    if present and max(gpu_counts) > present:
        raise ConfigError(f"--gpu-counts asks for {max(gpu_counts)} GPUs but this host has {present}; give counts "
                          f"from 1 to {present}.")
    return sorted(set(gpu_counts))


def measure_gpu_counts(config: RunConfig, gpu_counts: Sequence[int], out_dir: Path,
                       share_given: bool = False) -> dict[str, Any]:
    """rayfed's run of ``config`` on each of ``gpu_counts`` (see the module); ``share_given``: keep the config's
    ``placement.gpus_per_actor`` at every count instead of the spreading share."""
    counts = check_gpu_counts(config, gpu_counts)
    runs = []
    for gpus in counts:
        share = [] if share_given else [f"placement.gpus_per_actor={spread_share(config, gpus)}"]
        run_config = load_config(config, [f"ray.num_gpus={gpus}", *share])

        def each_round(rounds_done: int, wall: float, gpus: int = gpus) -> None:
            print(f"[bench] {gpus} GPU(s), round {rounds_done}: {wall:.2f} s", flush=True)

        ran = rayfed_run(run_config, out_dir / f"gpus_{gpus}", each_round)
        timed = slice(1, None) if len(ran["round_s"]) > 1 else slice(None)  # the first round warms up
        runs.append({
            "gpus": gpus, "actors": ran["actors"],
            "gpus_per_actor": {name: gpu_share(run_config, name) for name in architecture_names(run_config)},
            "cluster_gpus": ran["cluster_gpus"], "actor_gpus": ran["actor_gpus"], "round_s": ran["round_s"],
            "mean_round_s": statistics.mean(ran["round_s"][timed]),
            "mean_update_s": statistics.mean(ran["busiest_update_s"][timed]), "end_of_run_s": ran["end_of_run_s"],
            "peak_gpu_mib_per_actor": max((u["gpu_peak_bytes"] for u in ran["usage"]), default=0) / 2**20,
            "timelines": ran["timelines"], "metrics": ran["metrics"],
        })
    for run in runs:
        run["speedup"] = runs[0]["mean_round_s"] / run["mean_round_s"]
    return {"label": config.methods[0].label, "rounds": config.federation.rounds, "runs": runs,
            "logical_gpus": torch.cuda.device_count() == 0,
            "same_metrics": all(run["metrics"] == runs[0]["metrics"] for run in runs)}


def markdown(scaling: dict[str, Any]) -> str:
    """One row per GPU count."""
    runs = scaling["runs"]
    rows = [[str(run["gpus"]), str(run["actors"]), _shares(run["gpus_per_actor"]), f"{run['mean_round_s']:.3g}",
             f"{run['speedup']:.2f}", f"{run['mean_update_s']:.3g}", f"{run['end_of_run_s']:.3g}",
             f"{run['peak_gpu_mib_per_actor']:.0f}"] for run in runs]
    header = ["GPUs", "actors", "GPU share an actor", "s/round", f"x {runs[0]['gpus']} GPU(s)",
              "updates s (busiest actor)", "end of run s", "peak GPU MiB/actor"]
    notes = [f"rayfed's rounds of `{scaling['label']}` on each GPU count (rounds after the first)."]
    if scaling["logical_gpus"]:
        notes.append("This host has no GPU: the counts were Ray's logical GPUs and every actor trained on the CPU.")
    if not scaling["same_metrics"]:
        notes.append("**The metrics differ between GPU counts**: the packing changed the results.")
    return "\n\n".join(notes) + "\n\n" + format_table(rows, header)


def _shares(shares: dict[str, float | str]) -> str:
    """Each architecture's GPU share an actor (one value where every architecture has the same)."""
    if len(set(shares.values())) == 1:
        return str(next(iter(shares.values())))
    return ", ".join(f"{name} {share}" for name, share in shares.items())


def run_gpu_scaling(workload: str | MethodWorkload, out_dir: Path, gpu_counts: Sequence[int], rounds: int | None = None,
                    smoke: bool = False, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """The workload's rayfed run on each of ``gpu_counts`` (:func:`measure_gpu_counts`); writes ``bench.json`` and
    ``bench.md`` into ``out_dir``."""
    name, workload = resolved_workload(workload)
    config = workload_config(workload, rounds or workload.rounds, smoke, overrides)
    share_given = any(override.split("=", 1)[0].strip() == "placement.gpus_per_actor" for override in overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = results_header(name, workload, smoke, overrides, gpu_counts=list(gpu_counts))
    with tempfile.TemporaryDirectory(prefix=f"rayfed-bench-{name}-gpus-") as scratch:
        results["scaling"] = measure_gpu_counts(config, gpu_counts, Path(scratch), share_given)
    atomic_write_json(out_dir / "bench.json", results)
    timelines = "".join(f"\n{run['gpus']} GPU(s):\n{timeline_markdown(run)}" for run in results["scaling"]["runs"])
    atomic_write_text(out_dir / "bench.md", header_markdown(results) + markdown(results["scaling"]) + timelines)
    return results
