"""TAP's result tables (arXiv 2509.26524, Tables 1-6 and 8-10; docs/tap.md#data-and-metrics) from rayfed runs.

``python benchmarks/papers/tap_tables.py RUN_DIR [RUN_DIR ...]``: the run directories of one config at several
seeds (configs/tap/*). Every row is a method, or one of TAP's views (``TAP@pt`` = FedAvg + Post-train, ...), and
every column a dataset (a run task, or several: MMLU's subjects) with the mean over its (seed, client) pairs, or
an "Avg." column: the client-weighted mean over the (seed, client, dataset) pairs of a task key, as the paper
reports them. ``--replacements`` adds TAP's cumulative replacement counts per task (Fig. 3/4): the mean over
seeds of the replacements in the first and the second half of the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# (column, the run tasks it averages, the metric, its task key). Runs name their tasks as configs/tap/ do.
COLUMNS: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("TinyIN acc", ("tinyin",), "acc", "image_classification"),
    ("CIFAR acc", ("cifar",), "acc", "image_classification"),
    ("FMNIST MSE", ("fmnist",), "mse", "image_generation"),
    ("Caltech MSE", ("caltech",), "mse", "image_generation"),
    ("AG acc", ("agnews",), "acc", "text_classification"),
    ("MMLU F1", ("mmlu_law", "mmlu_medicine", "mmlu_moral", "mmlu_colors", "mmlu_shapes", "mmlu_numbers"), "token_f1",
     "text_generation"),
    ("MMLU MET", ("mmlu_law", "mmlu_medicine", "mmlu_moral", "mmlu_colors", "mmlu_shapes", "mmlu_numbers"), "meteor",
     "text_generation"),
    ("VQA F1", ("vqa",), "token_f1", "text_generation"),
    ("VQA MET", ("vqa",), "meteor", "text_generation"),
    ("CommonGen F1", ("commongen",), "token_f1", "text_generation"),
    ("CommonGen MET", ("commongen",), "meteor", "text_generation"),
)
AVERAGES: tuple[tuple[str, str, str], ...] = (  # (column, task key, metric)
    ("Avg.Cls", "image_classification", "acc"),
    ("Avg.Gen", "image_generation", "mse"),
    ("Avg F1", "text_generation", "token_f1"),
    ("Avg MET", "text_generation", "meteor"),
)
VIEWS = (("", ""), ("fedavg", "FedAvg"), ("pt", "FedAvg+PT"), ("pt2", "FedAvg+2P"), ("stage1", "TAP before stage 2"),
         ("nokd", "TAP No-KD"), ("kdalt", "TAP, alt_kd_weights"), ("global", "global"), ("adapted", "adapted"))


def _client_tasks(config: dict[str, Any]) -> dict[int, list[str]]:
    held: dict[int, list[str]] = {}
    for task in config["data"]["tasks"]:
        for client in task["clients"]:
            held.setdefault(client, []).append(task["name"])
    return held


def _value(metrics: dict[str, float], task: str, single: bool, metric: str, view: str) -> float | None:
    name = f"local_{metric}" if single else f"{task}/local_{metric}"
    return metrics.get(f"{name}@{view}" if view else name)


def rows(run_dirs: Sequence[Path]) -> dict[str, dict[str, tuple[float, float, int]]]:
    """Per row (method or method@view) and column: (mean, std, count) over seeds and clients (and datasets)."""
    samples: dict[str, dict[str, list[float]]] = {}
    for run_dir in run_dirs:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
        held = _client_tasks(summary["config"])
        for label, result in summary["methods"].items():
            for view, _ in VIEWS:
                row = f"{label}@{view}" if view else label
                for cid, metrics in result["clients"].items():
                    tasks = held[int(cid)]
                    for column, names, metric, key in COLUMNS:
                        values = [v for t in names if t in tasks
                                  if (v := _value(metrics, t, len(tasks) == 1, metric, view)) is not None]
                        if values:
                            samples.setdefault(row, {}).setdefault(column, []).append(sum(values) / len(values))
                            for average, average_key, average_metric in AVERAGES:
                                if average_key == key and average_metric == metric:
                                    samples[row].setdefault(average, []).append(sum(values) / len(values))
    return {row: {column: (statistics.fmean(v), statistics.pstdev(v), len(v)) for column, v in columns.items()}
            for row, columns in samples.items()}


def replacements(run_dirs: Sequence[Path], label: str = "TAP") -> dict[str, tuple[float, float]]:
    """Per task: TAP's replacements in the first and in the second half of the rounds, mean over runs."""
    halves: dict[str, list[tuple[float, float]]] = {}
    for run_dir in run_dirs:
        events = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
        rounds = [e for e in events if e.get("event") == "round" and e["method"] == label]
        last = max((e["round"] for e in rounds), default=0)
        counts: dict[str, list[float]] = {}
        for event in rounds:
            for name, value in event.get("client_stats", {}).items():
                if name.startswith("replaced/"):
                    first_half = event["round"] <= last / 2
                    counts.setdefault(name.removeprefix("replaced/"), [0.0, 0.0])[0 if first_half else 1] += value
        for task, (first, second) in counts.items():
            halves.setdefault(task, []).append((first, second))
    return {task: (statistics.fmean(f for f, _ in v), statistics.fmean(s for _, s in v)) for task, v in halves.items()}


def markdown(table: dict[str, dict[str, tuple[float, float, int]]], percent: bool = True) -> str:
    """One markdown table: rows x the columns any row has; accuracies and text metrics x100, MSE as is."""
    columns = [c for c, *_ in COLUMNS] + [c for c, *_ in AVERAGES]
    present = [c for c in columns if any(c in row for row in table.values())]
    lines = ["| method | " + " | ".join(present) + " |", "|---|" + "---:|" * len(present)]
    for row, values in table.items():
        cells = []
        for column in present:
            if column not in values:
                cells.append("")
                continue
            mean, std, _ = values[column]
            scale = 1.0 if "MSE" in column or column == "Avg.Gen" or not percent else 100.0
            digits = 4 if scale == 1.0 else 2
            cells.append(f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--replacements", action="store_true")
    args = parser.parse_args(argv)
    print(markdown(rows(args.runs)))
    if args.replacements:
        print("\n| task | replacements, rounds 1..T/2 | T/2+1..T |\n|---|---:|---:|")
        for task, (first, second) in sorted(replacements(args.runs).items()):
            print(f"| {task} | {first:.2f} | {second:.2f} |")


if __name__ == "__main__":
    main()
