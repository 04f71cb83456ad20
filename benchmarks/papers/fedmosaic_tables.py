"""Markdown tables of FedMosaic's offline results (``results.jsonl`` of ``benchmarks/papers/offline_runs.py``):
Self / Others A_last and A_AUC (token F1 x 100, mean +- std over seeds) next to the paper's, seed-paired gaps, the
RELA weight matrix's block structure by task group, and communication per round.

    python benchmarks/papers/fedmosaic_tables.py runs/fedmosaic/results.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from fedmosaic_configs import GROUPS

METRICS = (("self_token_f1", "a_last"), ("self_token_f1", "a_auc"), ("others_token_f1", "a_last"),
           ("others_token_f1", "a_auc"))
# Per setting, the paper's DRAKE numbers: Self A_last / A_AUC / Others A_last / A_AUC. Dynamic: Tab. 2 / 7 / 30 (the
# settings that share its clients too); static: Tab. 3.
DYNAMIC_PAPER = {"local": (65.79, 57.62, 47.66, 46.67), "fedavg": (66.11, 57.86, 47.63, 46.62),
         "ditto": (59.91, 54.16, 47.45, 46.70), "fedsim": (63.98, 56.42, 47.04, 46.15),
         "feddpa": (63.34, 55.74, 47.61, 46.64), "feddat_lora": (58.47, 54.38, 48.91, 47.78),
         "vanilla": (66.10, 57.87, 47.63, 46.62), "pq_lora": (66.99, 58.39, 51.33, 48.78),
         "fedmosaic": (67.86, 59.83, 51.16, 49.36), "training_current": (67.16, 59.38, None, None),
         "frozen_current": (67.24, 59.45, None, None), "takfl": (64.54, 56.19, 47.38, 46.47),
         "perada": (59.75, 54.48, 47.30, 46.72), "fedmkt": (61.38, 55.45, 47.50, 46.68)}
STATIC_PAPER = {"local": (68.50, 63.84, 47.91, 47.56), "fedmosaic": (70.10, 64.64, 51.57, 50.42),
                "takfl": (67.28, 62.42, 47.55, 47.51), "perada": (63.67, 59.03, 48.13, 47.60),
                "fedmkt": (65.81, 60.37, 47.19, 46.44)}
PAPER = {"dynamic": DYNAMIC_PAPER, "baselines": DYNAMIC_PAPER, "rela_variants": DYNAMIC_PAPER,
         "competitors": DYNAMIC_PAPER, "static": STATIC_PAPER, "competitors_static": STATIC_PAPER}


def load(paths: list[str]) -> list[dict[str, Any]]:
    rows = []
    for path in paths:
        rows += [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [row for row in rows if "error" not in row]


def _stem(row: dict[str, Any]) -> str:
    return row["config"].rsplit("/", 1)[-1]  # offline_runs names configs by their path under configs/


def _short(overrides: dict[str, Any]) -> str:
    return ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(overrides.items()))


def setting_of(row: dict[str, Any]) -> str:
    """The config's setting (``dynamic``, ``static``, ...), with offline_runs' ``--set`` overrides and
    ``--compute-match`` reference in braces: rows run with other values are another setting, paired with their own
    SFT."""
    matched = {"matched": row["compute_match_reference"]} if "compute_match_reference" in row else {}
    extra = _short({**row.get("set", {}), **matched})
    return _stem(row).removeprefix("offline_") + (f"{{{extra}}}" if extra else "")


def _paper_setting(row: dict[str, Any]) -> str | None:
    """The paper's setting a row reproduces (the paper's runs are compute matched), or None (overrides, --set)."""
    if row["overrides"] or row.get("set"):
        return None
    return _stem(row).removeprefix("offline_")


def key(row: dict[str, Any]) -> str:
    suffix = _short(row["overrides"])
    return f"{setting_of(row)}:{row['label']}" + (f"[{suffix}]" if suffix else "")


def _value(row: dict[str, Any], metric: str, stat: str) -> float:
    return 100 * row["stream"][metric][stat]


def _fmt(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def results_table(rows: list[dict[str, Any]]) -> str:
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        grouped[key(row)].append(row)
    lines = ["| setting:method | seeds | Self A_last | Self A_AUC | Others A_last | Others A_AUC | paper (DRAKE) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in sorted(grouped):
        group = grouped[name]
        cells = [_fmt([_value(r, m, s) for r in group]) for m, s in METRICS]
        paper = PAPER.get(_paper_setting(group[0]) or "", {}).get(group[0]["label"])
        paper_cell = " / ".join("—" if v is None else f"{v:.2f}" for v in paper) if paper else ""
        lines.append(f"| {name} | {len(group)} | {' | '.join(cells)} | {paper_cell} |")
    return "\n".join(lines)


# Settings whose configs are offline_dynamic's (offline_static's) with other methods (tests/test_offline_runs.py
# checks it): the same clients, data and rounds, so their methods pair by seed with that setting's.
SAME_CLIENTS = ("dynamic", "baselines", "rela_variants", "alignment", "competitors")
SAME_CLIENTS_STATIC = ("static", "competitors_static")


def paired_gaps(rows: list[dict[str, Any]], reference: str, setting: str = "dynamic") -> str:
    """Each method minus ``reference`` on the same seed (mean +- std of the seed-paired differences), for the
    methods of ``setting`` and, when it is ``dynamic``, of the settings that share its clients."""
    by_seed: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_seed[key(row)][row["seed"]] = row
    base = by_seed.get(f"{setting}:{reference}", {})
    # the same --set / compute matching over the same clients pair too
    base_setting, brace, extra = setting.partition("{")
    same_clients = {"dynamic": SAME_CLIENTS, "static": SAME_CLIENTS_STATIC}.get(base_setting)
    settings = tuple(same + brace + extra for same in same_clients) if same_clients else (setting,)
    lines = [f"| method - {setting}:{reference} | seeds | Self A_last | Self A_AUC | Others A_last | Others A_AUC |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in sorted(by_seed):
        if name.split(":")[0] not in settings or name == f"{setting}:{reference}":
            continue
        seeds = sorted(set(by_seed[name]) & set(base))
        cells = [_fmt([_value(by_seed[name][s], m, st) - _value(base[s], m, st) for s in seeds]) for m, st in METRICS]
        lines.append(f"| {name} | {len(seeds)} | {' | '.join(cells)} |")
    return "\n".join(lines)


def compute_matching(rows: list[dict[str, Any]]) -> str:
    """Per compute-matched setting:method (offline_runs --compute-match): its local update's cost ratio to the
    reference and the local steps it trained (the same for every seed unless the data shapes differ)."""
    grouped: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if "compute_match" in row:
            grouped[key(row)].append(row["compute_match"])
    lines = ["| setting:method | reference | cost ratio C | local steps |", "| --- | --- | ---: | ---: |"]
    for name in sorted(grouped):
        measured = grouped[name]
        steps = sorted({m["local_steps"] for m in measured})
        lines.append(f"| {name} | {measured[0]['reference']} | {statistics.mean(m['cost_ratio'] for m in measured):.3f}"
                     f" | {', '.join(map(str, steps))} |")
    return "\n".join(lines)


def group_of(client: int) -> str:
    return next("ABC"[g] for g, members in GROUPS.items() if client in members)


def block_structure(rows: list[dict[str, Any]], label: str = "fedmosaic", setting: str = "dynamic") -> str:
    """Mean RELA weight within a task group vs across groups (off-diagonal), per evaluation round, over seeds; and
    the last round's weight matrix averaged over seeds."""
    runs = [r for r in rows if key(r) == f"{setting}:{label}" and "history" in r]
    if not runs:
        return "(no relevance history)"
    rounds = len(runs[0]["history"])
    clients = len(runs[0]["history"][0])
    lines = ["| round | within-group w (off-diagonal) | cross-group w | ratio | self weight w_ii |",
             "| --- | --- | --- | --- | --- |"]
    for r in range(rounds):
        within, across, own = [], [], []
        for run in runs:
            weights = run["history"][r]
            for i in range(clients):
                own.append(weights[i][i])
                for j in range(clients):
                    if i != j:
                        (within if group_of(i) == group_of(j) else across).append(weights[i][j])
        if (r + 1) % 5 == 0 or r == 0:
            w, a = statistics.mean(within), statistics.mean(across)
            lines.append(f"| {r + 1} | {w:.4f} | {a:.4f} | {w / a:.2f} | {statistics.mean(own):.4f} |")
    final = [[statistics.mean(run["history"][-1][i][j] for run in runs) for j in range(clients)]
             for i in range(clients)]
    header = "| i \\ j | " + " | ".join(f"{j}{group_of(j)}" for j in range(clients)) + " |"
    matrix = [header, "| --- " * (clients + 1) + "|"]
    for i in range(clients):
        matrix.append(f"| {i}{group_of(i)} | " + " | ".join(f"{final[i][j]:.3f}" for j in range(clients)) + " |")
    return ("\n".join(lines) + "\n\nLast round's weights w_ij (mean over seeds; letter = task group):\n\n"
            + "\n".join(matrix))


def communication(rows: list[dict[str, Any]], rounds: int = 20) -> str:
    seen: dict[str, dict[str, int]] = {}
    for row in rows:
        if setting_of(row) == "dynamic" and not row["overrides"]:
            seen.setdefault(row["label"], row["comm_params"])
    lines = ["| method | uploaded parameters per round (10 clients) | downloaded per round | vs FedAvg upload |",
             "| --- | --- | --- | --- |"]
    fedavg = seen.get("fedavg", {}).get("up")
    for label, params in sorted(seen.items()):
        ratio = f"{params['up'] / fedavg:.3f}" if fedavg else "—"
        lines.append(f"| {label} | {params['up'] // rounds:,} | {params['down'] // rounds:,} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    rows = load(argv if argv is not None else sys.argv[1:])
    print("## Results\n\n" + results_table(rows))
    # Each setting with its own SFT rows pairs with them; the settings of SAME_CLIENTS pair with dynamic's.
    settings = sorted({key(row).split(":")[0] for row in rows if row["label"] == "local" and not row["overrides"]})
    for setting in settings:
        print(f"\n## Seed-paired gaps to SFT ({setting})\n\n" + paired_gaps(rows, "local", setting))
    if any("compute_match" in row for row in rows):
        print("\n## Compute matching\n\n" + compute_matching(rows))
    print("\n## RELA weights by task group\n\n" + block_structure(rows))
    print("\n## Communication\n\n" + communication(rows))


if __name__ == "__main__":
    main()
