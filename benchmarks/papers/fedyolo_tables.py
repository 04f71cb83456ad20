"""Mean +- std over seeds of the FedYolo study's metrics, as markdown tables (docs/fedyolo.md).

``python benchmarks/papers/fedyolo_tables.py RUN_DIR [RUN_DIR ...]``: the run directories of one
config run with different seeds. Per method: final mean local accuracy (and per task in multi-task
runs), uplink parameters per round and in total (the paper's T x M x P), the full/method uplink
ratio, rounds to 95% of fedavg-full's best accuracy, the uplink parameters sent until then (the
paper's cost at the target) and fedavg-full's over the method's, and the representation
shift when measured. With a global test set (``data.partition.global_test_samples``), the forgetting
ratio of every method ``X`` run next to ``X+local``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from rayfed.simulation import MetricsLog, rounds_to_target


def _mean_std(values: list[float], scale: float = 1.0) -> str:
    array = np.asarray(values, dtype=float) * scale
    return f"{array.mean():.1f} ± {array.std():.1f}"


def _rounds_to_target(events: list[dict], summary: dict) -> tuple[float | None, dict[str, int | None]]:
    """From the run's metrics events, with the study's target (docs/fedyolo.md#engine-metrics): 95% of the best mean
    local accuracy of the run's ``fedavg-full`` method, when the config sets none and the run has that method."""
    post_trained = {m["label"] for m in summary["config"]["methods"] if m["post_train_steps"]}
    target = summary["config"]["federation"]["target_acc"]
    full = [e["local_acc"] for e in events if e.get("event") == "eval" and e["method"] == "fedavg-full"]
    if target is None and full:
        target = 0.95 * max(full)
    return rounds_to_target(events, target, post_trained)


def _uplink_until(events: list[dict], label: str, rounds: int | None) -> float | None:
    """Uplink parameters ``label`` sent in its first ``rounds`` rounds (None: the target was never reached)."""
    if rounds is None:
        return None
    return sum(e["up_params"] for e in events
               if e.get("event") == "round" and e["method"] == label and e["round"] <= rounds)


def _cost_ratio(full: list[float | None], method: list[float | None]) -> str:
    """Mean over the seeds where both reached the target of full's cost over the method's."""
    ratios = [f / m for f, m in zip(full, method) if f is not None and m]
    return f"{np.mean(ratios):.1f}x ({len(ratios)} of {len(full)})" if ratios else "-"


def tables(run_dirs: list[Path]) -> str:
    summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs]
    for run_dir, summary in zip(run_dirs, summaries):
        events = MetricsLog.read(run_dir / "metrics.jsonl")
        summary["target_acc"], summary["rounds_to_target"] = _rounds_to_target(events, summary)
        summary["uplink_to_target"] = {
            label: _uplink_until(events, label, rounds) for label, rounds in summary["rounds_to_target"].items()
        }
    labels = [label for label in summaries[0]["methods"] if all(label in s["methods"] for s in summaries)]
    rounds = summaries[0]["config"]["federation"]["rounds"]
    full_label = next((label for label in labels if label.endswith("full")), None)
    tasks = list(summaries[0]["methods"][labels[0]].get("tasks", {}))
    head = ["method", "local acc (%)", *(f"{t} acc (%)" for t in tasks), "uplink params / round",
            "uplink params total", "full / method", "rounds to target", "uplink params to target",
            "full / method to target"]
    has_shift = "rep_shift" in summaries[0]["methods"][labels[0]]["mean"]
    if has_shift:
        head.append("rep. shift")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        results = [s["methods"][label] for s in summaries]
        up = [s["comm_params"][label]["up"] for s in summaries]
        row = [label, _mean_std([r["mean"]["local_acc"] for r in results], 100)]
        row += [_mean_std([r["tasks"][t]["local_acc"] for r in results], 100) for t in tasks]
        row += [f"{np.mean(up) / rounds:,.0f}", f"{np.mean(up):,.0f}"]
        if full_label is not None and np.mean(up) > 0:
            row.append(f"{np.mean([s['comm_params'][full_label]['up'] for s in summaries]) / np.mean(up):.1f}x")
        else:
            row.append("-")
        reached = [s["rounds_to_target"].get(label) for s in summaries]
        row.append(", ".join("never" if r is None else str(r) for r in reached))
        costs = [s["uplink_to_target"].get(label) for s in summaries]
        row.append(", ".join("-" if c is None else f"{c:,.0f}" for c in costs))
        full_costs = [s["uplink_to_target"].get(full_label) for s in summaries]
        row.append("-" if full_label is None else _cost_ratio(full_costs, costs))
        if has_shift:
            row.append(f"{np.mean([r['mean']['rep_shift'] for r in results]):.4f}")
        lines.append("| " + " | ".join(row) + " |")
    lines += _forgetting(summaries, labels)
    targets = ", ".join("-" if s["target_acc"] is None else f"{100 * s['target_acc']:.1f}%" for s in summaries)
    lines.append(f"\n{len(summaries)} seeds; rounds to target per seed (target = 95% of the best mean local "
                 f"accuracy of fedavg-full in that run: {targets}).")
    return "\n".join(lines)


def _forgetting(summaries: list[dict], labels: list[str]) -> list[str]:
    """The study's forgetting ratio (Acc_X - Acc_X+local) / Acc_X (docs/fedyolo.md#data), both global accuracies
    (every client's model on the global test set, averaged), for each X run next to X+local."""
    rows = []
    for label in labels:
        local = f"{label}+local"
        if local not in labels or "global_acc" not in summaries[0]["methods"][label]["mean"]:
            continue
        federated = [s["methods"][label]["mean"]["global_acc"] for s in summaries]
        personal = [s["methods"][local]["mean"]["global_acc"] for s in summaries]
        ratios = [(f - p) / f for f, p in zip(federated, personal)]
        rows.append(f"| {label} | {_mean_std(federated, 100)} | {_mean_std(personal, 100)} | "
                    f"{np.mean(ratios):.3f} ± {np.std(ratios):.3f} |")
    if not rows:
        return []
    return ["", "| method | global acc (%) | global acc after +local (%) | forgetting ratio |", "|---|---|---|---|",
            *rows]


if __name__ == "__main__":
    print(tables([Path(arg) for arg in sys.argv[1:]]))
