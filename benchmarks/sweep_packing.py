"""Trials per hour of a Ray Tune sweep at paper size: one trial at a time against trials packed by measured memory.

The same sweep (a paper config's offline twin, its method alone, a grid of its hyperparameters) runs twice on the
same GPUs and the same Ray instance:

- **one at a time**: the twin's own ``clients_per_actor``, each actor's GPU share spread so that a trial has every
  GPU (``1 / ceil(actors / GPUs)``), ``tune.max_concurrent_trials: 1``;
- **packed**: ``placement.gpus_per_actor: measured`` (``rayfed.simulation.gpu_memory``: one probe before the
  sweep, then every trial asks for the measured share), ``--packed-clients-per-actor`` clients an actor (default:
  all, one actor a trial), and as many trials at once as the GPUs and CPUs hold.

Trials are shortened so that both sweeps end in minutes (the twin's model sizes, batch, image and text shapes are
kept; what is shortened is written into the results): one client of each of the twin's client patterns
(``--clients``), ``--samples`` samples a client and task, ``--rounds`` rounds of ``--steps`` steps, a short post-FL
stage. The results do not depend on the packing: both ways' trials end with the same metric.

    python -m rayfed.benchmarks.sweep_packing --gpus 1 --workload tap --out results/sweep_packing_tap

Writes ``sweep_packing.json`` and ``sweep_packing.md``: per way, the trials, the sweep's wall time, trials per
hour and the GPU share an actor asked for; per trial, its values, wall time, metric and peak GPU memory (each
actor's allocator peak at the last round); the most memory each GPU held during each sweep (``nvidia-smi``); and
packed / one at a time.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import shutil
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from rayfed.errors import ConfigError, choice_error
from rayfed.io import atomic_write_json, atomic_write_text
from rayfed.results.report import format_table

REPO = Path(__file__).resolve().parents[1]
ACTOR_MEMORY_FILE = "actor_memory.json"


@dataclass(frozen=True)
class SweepWorkload:
    """A sweep of method ``label`` (the only method kept) of ``config`` (from the repository's root) over ``space``
    (``tune.space``), shortened by ``overrides`` (``key=value``)."""

    config: str
    label: str
    space: dict[str, Any]
    overrides: tuple[str, ...]
    clients: int | None  # keep clients 0..clients-1 (None: all)
    samples: int | None  # samples a client and task (None: the config's)


WORKLOADS: dict[str, SweepWorkload] = {
    # TAP's replacement margins (x1, x2, x4 of the paper's) and KD temperature (docs/tap.md) on the FLAVA-full twin;
    # one client of each of its ten client patterns (clients 10-29 repeat 0-9). Six trials: two waves of the three
    # that one H200 holds at once. One at a time, a trial keeps the twin's placement of its measurements (8 clients
    # an actor: 2 actors for 10 clients); the paper config now hosts all 30 clients on one measured actor.
    "tap": SweepWorkload(
        "configs/tap/paper_flava_offline.yaml", "TAP",
        {"methods.0.margins": {"grid": [[0.01, 0.005, 0.005, 0.01], [0.02, 0.01, 0.01, 0.02],
                                        [0.04, 0.02, 0.02, 0.04]]},
         "methods.0.kd_temperature": {"grid": [1.0, 2.0]}},
        ("methods.0.post_fl_microbatches=4", "methods.0.two_p=false", "methods.0.no_kd=false",
         "methods.0.alt_kd_weights=null", "placement.clients_per_actor=8"), clients=10, samples=160),
    # FedMosaic's N_B (PQ-LoRA blocks, which change the model: each value is measured) on the LLaVA mix's twin.
    "fedmosaic": SweepWorkload(
        "configs/fedmosaic/paper_drake_static_offline.yaml", "fedmosaic", {"methods.0.blocks": {"grid": [2, 4]}},
        (), clients=None, samples=None),
    # The quickstart's size, for a CPU (--smoke): FedAvg's learning rate, two trials.
    "smoke": SweepWorkload("configs/quickstart.yaml", "fedavg", {"train.lr": {"grid": [0.005, 0.01]}}, (),
                           clients=4, samples=None),
}


def sweep_config(workload: SweepWorkload, rounds: int, steps: int, clients: int | None,
                 samples: int | None) -> dict[str, Any]:
    """The workload's sweep as a config dict: its method alone, ``clients`` clients (the ids below it) with ``samples``
    samples a client and task, ``rounds`` rounds of ``steps`` local steps evaluated once at the end, no checkpoints,
    and a grid over the workload's space."""
    from rayfed.config import apply_overrides

    raw = yaml.safe_load((REPO / workload.config).read_text())
    methods = [m for m in raw["methods"] if (m if isinstance(m, str) else m.get("label", m["name"])) == workload.label]
    if not methods:
        raise ConfigError(f"{workload.config}: no method is labelled {workload.label!r}.")
    raw["methods"] = methods
    if clients is not None:
        raw["data"] = fewer_clients(raw["data"], clients, samples)
    raw = apply_overrides(raw, [f"federation.rounds={rounds}", f"federation.eval_every={rounds + 1}",
                                "federation.checkpoint_every=0", f"federation.clients_per_round="
                                f"{min(raw['federation'].get('clients_per_round', 10), clients or 10**9)}",
                                f"train.local_steps={steps}", "train.local_epochs=null", *workload.overrides])
    raw["tune"] = {"metric": f"{workload.label}/local_acc", "mode": "max", "search": "grid", "num_samples": 1,
                   "scheduler": {"name": "fifo"}, "space": workload.space}
    return raw


def fewer_clients(data: dict[str, Any], clients: int, samples: int | None) -> dict[str, Any]:
    """``data`` with the clients below ``clients`` only (each task keeps its clients among them, and ``samples`` samples
    a kept client, else its share of the task's samples); a task left without clients is an error."""
    data = json.loads(json.dumps(data))
    if data.get("tasks") is None:
        data["num_clients"] = clients
        return data
    for task in data["tasks"]:
        held = [c for c in task["clients"] if c < clients]
        if not held:
            raise ConfigError(f"data.tasks[{task['name']!r}] has no client below {clients}; keep more clients.")
        options = task.setdefault("options", {})
        if samples is not None:
            options["num_samples"] = samples * len(held)
        elif "num_samples" in options:
            options["num_samples"] = math.ceil(options["num_samples"] * len(held) / len(task["clients"]))
        task["clients"] = held
    return data


def one_at_a_time(raw: dict[str, Any], gpus: int) -> dict[str, Any]:
    """The sweep run one trial at a time, each trial's actors sharing out every GPU."""
    from rayfed.benchmarks.gpu_scaling import spread_share
    from rayfed.config import build_config

    share = spread_share(build_config({**raw, "tune": None}), gpus)
    placement = {**raw.get("placement", {}), "gpus_per_actor": share}
    return {**raw, "placement": placement, "tune": {**raw["tune"], "max_concurrent_trials": 1}}


def packed(raw: dict[str, Any], clients_per_actor: int | None) -> dict[str, Any]:
    """The sweep packed by measured memory: as many trials at once as fit."""
    from rayfed.config import build_config

    num_clients = build_config({**raw, "tune": None}).data.num_clients
    placement = {**raw.get("placement", {}), "gpus_per_actor": "measured",
                 "clients_per_actor": clients_per_actor or num_clients}
    tune = {key: value for key, value in raw["tune"].items() if key != "max_concurrent_trials"}
    return {**raw, "placement": placement, "tune": tune}


def trials_per_hour(completed: int, wall_s: float) -> float:
    return completed / wall_s * 3600 if wall_s > 0 else 0.0


def same_metrics(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> bool | None:
    """Whether the trials both sweeps completed with the same values ended with the same metric (None: no such
    trial)."""
    done = {json.dumps(t["params"], sort_keys=True): t["metric"] for t in first if t["status"] == "completed"}
    both = [(done[key], t["metric"]) for t in second if t["status"] == "completed"
            and (key := json.dumps(t["params"], sort_keys=True)) in done]
    return all(a == b for a, b in both) if both else None


def span_s(spans: list[tuple[float, float]]) -> float:
    """Seconds from the first span's start to the last one's end (0 without spans): a sweep's trials without its
    start-up (Ray Tune's, and the packed sweep's memory probe)."""
    return max(end for _, end in spans) - min(start for start, _ in spans) if spans else 0.0


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most of the (start, end) spans that overlap at one time."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


class ActorMemory:
    """A round callback: after a trial's last round, each actor's resources (peak GPU memory) into its run folder."""

    def __call__(self, sim: Any, label: str, rounds_done: int) -> None:
        if rounds_done == sim.config.federation.rounds:
            usage = sim.executor.get([actor.resource_usage.remote() for actor in sim.actors])
            atomic_write_json(sim.run_dir / ACTOR_MEMORY_FILE, usage)


def gpu_names() -> str | None:
    """The GPUs' names from nvidia-smi (this process creates no CUDA context of its own); None without it."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                         check=False).stdout
    return ", ".join(line.strip() for line in out.strip().splitlines()) or None


class GpuSampler:
    """The most memory each GPU holds while it runs (``nvidia-smi``, every ``period_s``); {} without nvidia-smi."""

    def __init__(self, period_s: float = 1.0):
        self.period_s, self.most_mib = period_s, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while not self._stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=False).stdout
            for line in out.strip().splitlines():
                index, used = (part.strip() for part in line.split(","))
                self.most_mib[index] = max(self.most_mib.get(index, 0), int(used))
            self._stop.wait(self.period_s)


def run_sweep(raw: dict[str, Any], out_dir: Path, budget_s: float | None = None) -> dict[str, Any]:
    """One sweep through ``rayfed.tune.tune`` (stopped by Tune past ``budget_s`` seconds of trials): its wall time,
    trials per hour (trials completed over the wall time) and each trial's record."""
    from rayfed.tune import tune

    error = None
    with GpuSampler() as sampler:
        started = time.perf_counter()
        try:
            tune(raw, out_dir=out_dir, callbacks=[ActorMemory()], verbose=0, time_budget_s=budget_s)
        except RuntimeError as err:  # no trial completed (within the budget): the table says how far they got
            error = str(err)
        wall_s = time.perf_counter() - started
    tune_dir = out_dir / "tune"
    with (tune_dir / "trials.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    trials, spans = [], []
    for row in rows:
        run_dir = tune_dir / "runs" / row.pop("trial")
        status, metric = row.pop("status"), row.pop(raw["tune"]["metric"])
        row.pop("round")
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        usage_path = run_dir / ACTOR_MEMORY_FILE
        usage = json.loads(usage_path.read_text()) if usage_path.is_file() else []
        if summary:
            end = summary_path.stat().st_mtime
            spans.append((end - summary["wall_time_s"], end))
        trials.append({"trial": run_dir.name, "params": row, "status": status,
                       "metric": float(metric) if metric else None, "wall_s": summary.get("wall_time_s"),
                       "peak_gpu_mib_per_actor": [round(u["gpu_peak_bytes"] / 2**20) for u in usage],
                       "gpu_memory": summary.get("gpu_memory")})
    completed = sum(trial["status"] == "completed" for trial in trials)
    measurements = tune_dir / "gpu_memory.json"
    return {"wall_s": wall_s, "budget_s": budget_s, "completed": completed,
            "trials_per_hour": trials_per_hour(completed, wall_s), "trials_span_s": span_s(spans),
            "trials_per_hour_in_span": trials_per_hour(completed, span_s(spans)),
            "most_trials_at_once": most_at_once(spans),
            "most_gpu_mib_used": sampler.most_mib, "error": error,
            "measurements": json.loads(measurements.read_text()) if measurements.is_file() else None, "trials": trials}


def run_packing_bench(workload: str, gpus: int, out_dir: Path, rounds: int = 1, steps: int = 2,
                      clients: int | None = None, samples: int | None = None,
                      packed_clients_per_actor: int | None = None, cpus: int | None = None,
                      ways: tuple[str, ...] = ("one_at_a_time", "packed"), budget_s: float | None = None
                      ) -> dict[str, Any]:
    """Both sweeps of ``workload`` on a local Ray of ``gpus`` GPUs (and ``cpus`` CPUs; default: all); writes
    sweep_packing.json / .md into ``out_dir`` after each."""
    import ray
    import torch

    from rayfed.simulation import init_local_ray

    if workload not in WORKLOADS:
        raise choice_error("--workload", workload, WORKLOADS)
    chosen = WORKLOADS[workload]
    clients = chosen.clients if clients is None else clients
    samples = chosen.samples if samples is None else samples
    raw = sweep_config(chosen, rounds, steps, clients, samples)
    configs = {"one_at_a_time": one_at_a_time(raw, gpus), "packed": packed(raw, packed_clients_per_actor)}
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "workload": {"name": workload, **asdict(chosen), "gpus": gpus},
        "shortened": {"rounds": rounds, "local_steps": steps, "clients": clients, "samples_per_client_task": samples,
                      "evaluation": "once, at the end", "overrides": list(chosen.overrides)},
        "machine": {"gpu": gpu_names(), "torch": torch.__version__},
        "placement": {way: configs[way]["placement"] for way in ways}, "sweeps": {},
    }
    init_local_ray(num_cpus=cpus, num_gpus=gpus, object_store_memory=4 * 10**9)
    try:
        for way in ways:
            print(f"[sweep_packing] {workload}: {way} ...", flush=True)
            try:
                sweep = results["sweeps"][way] = run_sweep(configs[way], out_dir / way, budget_s)
            except Exception as err:  # noqa: BLE001 - the other way still runs; the error goes into the results
                results.setdefault("failed", {})[way] = f"{type(err).__name__}: {err}"
                print(f"[sweep_packing] {way} failed: {results['failed'][way]}", flush=True)
            else:
                print(f"[sweep_packing] {way}: {sweep['completed']} trials in {sweep['wall_s']:.1f} s, "
                      f"{sweep['trials_per_hour']:.1f} trials/hour, at most {sweep['most_trials_at_once']} at once",
                      flush=True)
            _write(out_dir, results)
    finally:
        ray.shutdown()
    return results


def _write(out_dir: Path, results: dict[str, Any]) -> None:
    sweeps = results["sweeps"]
    if {"one_at_a_time", "packed"} <= set(sweeps):
        for rate, ratio in (("trials_per_hour", "packed_over_one_at_a_time"),
                            ("trials_per_hour_in_span", "packed_over_one_at_a_time_in_span")):
            if sweeps["one_at_a_time"].get(rate):
                results[ratio] = sweeps["packed"][rate] / sweeps["one_at_a_time"][rate]
        results["same_metrics_both_ways"] = same_metrics(sweeps["one_at_a_time"]["trials"], sweeps["packed"]["trials"])
    atomic_write_json(out_dir / "sweep_packing.json", results)
    atomic_write_text(out_dir / "sweep_packing.md", markdown(results))


def markdown(results: dict[str, Any]) -> str:
    workload, shortened = results["workload"], results["shortened"]
    rows, trial_rows = [], []
    for way, sweep in results["sweeps"].items():
        share = results["placement"][way]["gpus_per_actor"]
        if share == "measured":
            shares = {t["gpu_memory"][name]["gpus_per_actor"] for t in sweep["trials"] if t["gpu_memory"]
                      for name in t["gpu_memory"]}
            share = f"measured: {', '.join(f'{s:g}' for s in sorted(shares)) or '-'}"
        walls = [t["wall_s"] for t in sweep["trials"] if t["status"] == "completed" and t["wall_s"] is not None]
        mean_wall = f"{sum(walls) / len(walls):.1f}" if walls else "-"
        rows.append([way, str(sweep["completed"]), f"{sweep['wall_s']:.1f}", mean_wall,
                     f"{sweep['trials_per_hour']:.1f}", f"{sweep.get('trials_per_hour_in_span', 0):.1f}",
                     str(sweep["most_trials_at_once"]), str(share),
                     str(results["placement"][way]["clients_per_actor"]),
                     ", ".join(f"{mib:,}" for _, mib in sorted(sweep["most_gpu_mib_used"].items())) or "-"])
        for trial in sweep["trials"]:
            trial_rows.append([way, trial["trial"], json.dumps(trial["params"]), trial["status"],
                               "-" if trial["wall_s"] is None else f"{trial['wall_s']:.1f}",
                               "-" if trial["metric"] is None else f"{trial['metric']:.4f}",
                               ", ".join(f"{mib:,}" for mib in trial["peak_gpu_mib_per_actor"]) or "-"])
    ratio = results.get("packed_over_one_at_a_time")
    samples = shortened["samples_per_client_task"] or "the config's"
    return (f"Workload `{workload['name']}`: {workload['config']}, {workload['label']} alone, on {workload['gpus']} "
            f"GPU(s) ({results['machine']['gpu'] or 'none'}; torch {results['machine']['torch']})\n\n"
            f"Shortened: {shortened['rounds']} round(s) of {shortened['local_steps']} local steps, clients 0-"
            f"{(shortened['clients'] or 0) - 1 if shortened['clients'] else 'all'}, "
            f"{samples} samples a client and task, evaluated once at the "
            f"end; {' '.join(shortened['overrides']) or 'no other overrides'}\n\n"
            + format_table(rows, ["way", "trials done", "sweep wall s", "mean trial wall s", "trials/hour",
                                  "trials/hour, first trial's start to last one's end", "most trials at once",
                                  "GPU share an actor", "clients an actor", "most GPU MiB used (nvidia-smi, per GPU)"])
            + ("" if ratio is None else f"\nTrials per hour, packed / one at a time: **{ratio:.2f}** (over the "
               f"trials' span alone: {results.get('packed_over_one_at_a_time_in_span', float('nan')):.2f}); the same "
               f"trials' metrics equal both ways: {results.get('same_metrics_both_ways')}\n")
            + "".join(f"\n{way} failed: {error}\n" for way, error in results.get("failed", {}).items())
            + "\n" + format_table(trial_rows, ["way", "trial", "values", "status", "wall s", "metric",
                                               "peak GPU MiB per actor (allocated, last round)"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="tap", help=f"one of {', '.join(WORKLOADS)}")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of the local Ray both sweeps run on")
    parser.add_argument("--cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="local steps of every update")
    parser.add_argument("--clients", type=int, default=None, help="keep clients 0..N-1 (default: the workload's)")
    parser.add_argument("--samples", type=int, default=None, help="samples a client and task (default: the workload's)")
    parser.add_argument("--packed-clients-per-actor", type=int, default=None, help="default: all (one actor a trial)")
    parser.add_argument("--only", choices=("one_at_a_time", "packed"), default=None, help="run one of the two sweeps")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="Tune stops a sweep past this many seconds of trials (trials/hour: those completed)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    ways = (args.only,) if args.only else ("one_at_a_time", "packed")
    results = run_packing_bench(args.workload, args.gpus, args.out, args.rounds, args.steps, args.clients,
                                args.samples, args.packed_clients_per_actor, args.cpus, ways, args.budget_s)
    print(markdown(results))


if __name__ == "__main__":
    main()
