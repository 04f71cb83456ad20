"""Markdown tables of FedDAT's offline results (FedDAT, arXiv 2308.12305: Tables 2-4 and Fig. 5; docs/feddat.md#results)
from the ``results.jsonl`` files of ``benchmarks/papers/offline_runs.py`` (plans ``feddat-*``):
final-round ``local_acc`` (%) per method and benchmark, mean ± std over seeds, next to the paper's ViLT numbers;
the ablations and inference views (Table 4); the convergence at rounds 5 / 10 / 15 / 20 (Fig. 5); and the
seed-paired gaps the acceptance asks about.

    python benchmarks/papers/feddat_tables.py runs/feddat/results.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

BENCHMARKS = ("domain", "function", "scene")
# The paper's ViLT rows (Tables 2-4: VQA score, mean over its 3 seeds) per benchmark.
PAPER: dict[str, tuple[float, float, float]] = {
    "clf-L": (50.04, 31.58, 24.52), "LoRA": (51.07, 32.04, 28.47), "prompt": (53.45, 40.53, 30.53),
    "bias": (56.28, 43.81, 33.65), "Adapter-L": (54.67, 39.68, 31.91), "Adapter": (57.13, 48.37, 31.07),
    "FedDAT": (61.11, 54.39, 39.35), "full-L": (60.97, 56.81, 38.00), "full": (63.55, 59.62, 40.62),
    "FedDAT-no_frozen": (58.24, 50.62, 33.04), "FedDAT-no_local": (57.87, 50.93, 32.45),
    "FedDAT-no_mkd": (58.41, 52.82, 36.98), "FedDAT@dat": (58.45, 50.42, 35.61), "FedDAT@local": (55.87, 46.14, 32.84),
}
MAIN_ROWS = ("clf-L", "LoRA", "prompt", "bias", "Adapter-L", "Adapter", "FedDAT", "full-L", "full")
ABLATION_ROWS = ("Adapter", "FedDAT-no_frozen", "FedDAT-no_local", "FedDAT-no_mkd", "FedDAT", "FedDAT@dat",
                 "FedDAT@local")


def load(paths: list[str]) -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    """(benchmark, row) -> seed -> {"final": local_acc, "curve": {round: local_acc}}; a row is a method label, or
    ``label@view`` for FedDAT's inference views."""
    table: dict[tuple[str, str], dict[int, dict[str, Any]]] = defaultdict(dict)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            if "error" in row or not row["plan"].startswith("feddat-") or row["overrides"]:
                continue
            benchmark = row["plan"].removeprefix("feddat-")
            for view in ("", "@dat", "@local"):
                metric = f"local_acc{view}"
                if metric not in row["mean"]:
                    continue
                table[(benchmark, row["label"] + view)][row["seed"]] = {
                    "final": 100 * row["mean"][metric],
                    "curve": {e["round"]: 100 * e[metric] for e in row["curves"] if metric in e}}
    return table


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.1f} ± {std:.1f}"


def results_table(table: dict[tuple[str, str], dict[int, dict[str, Any]]], rows: tuple[str, ...]) -> str:
    header = "| method | " + " | ".join(f"{b.capitalize()} (ours) | paper" for b in BENCHMARKS) + " | seeds |"
    lines = [header, "| --- |" + " ---: | ---: |" * len(BENCHMARKS) + " ---: |"]
    for name in rows:
        cells, seeds = [], set()
        for index, benchmark in enumerate(BENCHMARKS):
            runs = table.get((benchmark, name), {})
            seeds |= set(runs)
            cells += [_stats([run["final"] for run in runs.values()]), f"{PAPER[name][index]:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {len(seeds)} |")
    return "\n".join(lines)


def convergence_table(table: dict[tuple[str, str], dict[int, dict[str, Any]]], rows: tuple[str, ...]) -> str:
    lines = ["| benchmark | " + " | ".join(rows) + " |", "| --- |" + " --- |" * len(rows)]
    for benchmark in BENCHMARKS:
        cells = []
        for name in rows:
            runs = list(table.get((benchmark, name), {}).values())
            rounds = sorted(set.intersection(*(set(run["curve"]) for run in runs))) if runs else []
            cells.append(" / ".join(f"{statistics.mean(run['curve'][r] for run in runs):.1f}" for r in rounds) or "-")
        lines.append(f"| {benchmark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_gaps(table: dict[tuple[str, str], dict[int, dict[str, Any]]], better: str, worse: str,
                at_round: int | None = None) -> str:
    """``better - worse`` per benchmark: the mean and each seed's gap (final round, or ``at_round``)."""
    parts = []
    for benchmark in BENCHMARKS:
        a, b = table.get((benchmark, better), {}), table.get((benchmark, worse), {})
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        pick = (lambda run: run["final"]) if at_round is None else (lambda run: run["curve"][at_round])
        gaps = [pick(a[s]) - pick(b[s]) for s in seeds]
        parts.append(f"{benchmark} {statistics.mean(gaps):+.1f} ({', '.join(f'{g:+.1f}' for g in gaps)}; "
                     f"{sum(g > 0 for g in gaps)}/{len(gaps)} seeds ahead)")
    where = f" at round {at_round}" if at_round else ""
    return f"- {better} - {worse}{where}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    table = load(sys.argv[1:] if argv is None else argv)
    print("## Final-round local_acc (%)\n\n" + results_table(table, MAIN_ROWS))
    print("\n## Ablations and inference views (Table 4)\n\n" + results_table(table, ABLATION_ROWS))
    print("\n## Convergence (Fig. 5): rounds 5 / 10 / 15 / 20\n\n"
          + convergence_table(table, ("clf-L", "Adapter-L", "Adapter", "FedDAT")))
    print("\n## Seed-paired gaps\n")
    for better, worse, at_round in (("FedDAT", "Adapter", None), ("FedDAT", "Adapter", 5),
                                    ("Adapter", "Adapter-L", None), ("Adapter-L", "clf-L", None),
                                    ("FedDAT", "FedDAT-no_mkd", None), ("FedDAT-no_mkd", "FedDAT-no_frozen", None),
                                    ("FedDAT-no_mkd", "FedDAT-no_local", None), ("FedDAT-no_frozen", "Adapter", None),
                                    ("FedDAT-no_local", "Adapter", None), ("FedDAT", "FedDAT@dat", None),
                                    ("FedDAT@dat", "FedDAT@local", None)):
        print(paired_gaps(table, better, worse, at_round))


if __name__ == "__main__":
    main()
