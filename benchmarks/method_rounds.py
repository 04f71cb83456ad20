"""Seconds per round of a paper method on its offline config: training rounds and one evaluation of every client,
timed apart. What a user of ``rayfed run`` waits for, and what ``benchmarks/README.md`` records for the seed
methods ("The seed methods' offline configs").

    python -m rayfed.benchmarks.method_rounds --config configs/fedmosaic/offline_static.yaml --label fedmosaic \\
        --rounds 4 --set placement.gpus_per_actor=0.3 --out results/fedmosaic_rounds.json

The run evaluates only at its end (``federation.eval_every`` past the last round), so each round's time is its
training and aggregation; the evaluation is the end-of-run evaluation of every client (with a method's post-FL
stage, when it has one). The first round also holds the actors' start-up and any pre-federation stage, so the
steady round is the median of the others. With ``placement.executor=local`` everything runs in this process, and its
CPU seconds (``round_cpu_seconds``, ``evaluation_cpu_s``) are less moved than wall seconds by other work on a shared
machine.

``--public-passes`` (a method with server-side passes on public data: TAKFL, PerAda, FedMKT) runs the actors in
this process (``placement.executor=local``, one after the other) and splits each round into the clients' training
(summed over the actors) and each public pass, which runs twice from the same request: one adapter at a time (as
before the passes grouped adapters) and with its adapters grouped into shared steps
(``rayfed.models.peft.lora_groups``; its results go on), so that both see the same machine load. The first pass 0
also encodes the public data (in the one-at-a-time column). What ``docs/fedmosaic.md`` records for FedMKT:

    python -m rayfed.benchmarks.method_rounds --config configs/fedmosaic/offline_competitors_static.yaml \
        --label fedmkt --rounds 2 --public-passes
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import yaml

from rayfed.compute import WITHOUT_MATCHING


def time_method(config: Path, label: str, rounds: int, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """Run method ``label`` of ``config`` alone for ``rounds`` rounds; its round and evaluation times."""
    from rayfed.simulation import Simulation

    methods = yaml.safe_load(config.read_text())["methods"]
    chosen = [m for m in methods if (m if isinstance(m, str) else m.get("label", m["name"])) == label]
    if not chosen:
        raise SystemExit(f"--label {label!r} is not a method label of {config}")
    ends: list[float] = []
    cpu_ends: list[float] = []  # the process's CPU seconds (all its threads), less moved by other work on the machine

    def round_end(*_: Any) -> None:
        ends.append(time.perf_counter())
        cpu_ends.append(time.process_time())

    simulation = Simulation(str(config), out_dir=str(out_dir), callbacks=[round_end],
                            overrides=[f"federation.rounds={rounds}", f"federation.eval_every={rounds + 1}",
                                       f"federation.checkpoint_every={rounds + 1}", f"methods={json.dumps(chosen)}",
                                       WITHOUT_MATCHING, *overrides])
    start, cpu_start = time.perf_counter(), time.process_time()
    summary = simulation.run()
    end, cpu_end = time.perf_counter(), time.process_time()
    round_seconds = [b - a for a, b in zip([start, *ends], ends)]
    round_cpu_seconds = [b - a for a, b in zip([cpu_start, *cpu_ends], cpu_ends)]
    mean = summary["methods"][label]["mean"]
    return {
        "config": str(config), "label": label, "rounds": rounds, "overrides": overrides,
        "round_seconds": round_seconds,
        "steady_round_s": statistics.median(round_seconds[1:] or round_seconds),
        "evaluation_s": end - ends[-1],
        "total_s": end - start,
        "round_cpu_seconds": round_cpu_seconds,
        "steady_round_cpu_s": statistics.median(round_cpu_seconds[1:] or round_cpu_seconds),
        "evaluation_cpu_s": cpu_end - cpu_ends[-1],
        "metrics": {name: value for name, value in mean.items() if "/" not in name},
    }


def _largest_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between the floating tensors of two results, relative to each tensor's largest entry."""
    import torch

    worst = 0.0
    for name, value in a.items():
        if torch.is_floating_point(value) and value.numel():
            scale = max(float(value.abs().max()), 1e-12)
            worst = max(worst, float((value - b[name]).abs().max()) / scale)
    return worst


def time_public_passes(config: Path, label: str, rounds: int, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """:func:`time_method` in this process, with each round's client training and public passes timed apart (each
    pass one adapter at a time and grouped, from the same request)."""
    from rayfed.training import public_pass
    from rayfed.actors.client import ClientActor

    split: dict[int, dict[str, Any]] = {}
    train_round, public_pass, groupable = ClientActor.train_round, ClientActor.public_pass, public_pass.groupable

    def timed_train_round(actor: ClientActor, round_idx: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = train_round(actor, round_idx, *args, **kwargs)
        row = split.setdefault(round_idx + 1, {"client_training_s": 0.0})
        row["client_training_s"] += time.perf_counter() - start
        return result

    def timed_public_pass(actor: ClientActor, method_index: int, round_idx: int, index: int, request: Any) -> Any:
        start = time.perf_counter()
        public_pass.groupable = lambda *_: False
        try:
            alone = public_pass(actor, method_index, round_idx, index, dict(request))
        finally:
            public_pass.groupable = groupable
        middle = time.perf_counter()
        grouped = public_pass(actor, method_index, round_idx, index, dict(request))
        end = time.perf_counter()
        row = split[round_idx + 1].setdefault(f"pass_{index}", {"one_at_a_time_s": 0.0, "grouped_s": 0.0,
                                                                "largest_relative_difference": 0.0})
        row["one_at_a_time_s"] += middle - start
        row["grouped_s"] += end - middle
        row["largest_relative_difference"] = max(row["largest_relative_difference"],
                                                 _largest_difference(alone, grouped))
        return grouped

    ClientActor.train_round, ClientActor.public_pass = timed_train_round, timed_public_pass
    try:
        result = time_method(config, label, rounds, ["placement.executor=local", *overrides], out_dir)
    finally:
        ClientActor.train_round, ClientActor.public_pass = train_round, public_pass
    return {**result, "split": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--label", required=True, help="the method's label in the config")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file to write (default: print only)")
    parser.add_argument("--public-passes", action="store_true",
                        help="in this process: client training and each public pass timed apart (see above)")
    args = parser.parse_args()
    out_dir = Path("runs") / f"method_rounds_{args.label}_{int(time.time())}"
    timer = time_public_passes if args.public_passes else time_method
    result = timer(args.config, args.label, args.rounds, args.overrides, out_dir)
    print(json.dumps({k: v for k, v in result.items() if k != "metrics"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
