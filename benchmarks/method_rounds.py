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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import yaml


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
                                       *overrides])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--label", required=True, help="the method's label in the config")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--set", dest="overrides", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file to write (default: print only)")
    args = parser.parse_args()
    out_dir = Path("runs") / f"method_rounds_{args.label}_{int(time.time())}"
    result = time_method(args.config, args.label, args.rounds, args.overrides, out_dir)
    print(json.dumps({k: v for k, v in result.items() if k != "metrics"}, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
