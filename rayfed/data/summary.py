"""What each client holds, before a run: train / test sample counts and the histogram of its training samples over
labels (one task with labels) or over tasks (several tasks, or a task without labels), as a dict, a terminal table
and a stacked-bar PNG (``rayfed data``, ``Simulation.data_summary``)."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure

from rayfed.data.clients import Federation, Holding
from rayfed.results.report import _save_figure


def data_summary(federation: Federation) -> dict[str, Any]:
    """``{"by": "label" | "task", "categories": [...], "clients": {id: {"num_train", "num_test", "counts"}},
    "total": {"num_train", "num_test"}}``; ``counts`` are the client's training samples per category."""
    by_label = len(federation.holdings) == 1 and federation.holdings[0].dataset.labels is not None
    # A base/novel holding is one dataset under its first task's name (the novel task has no samples of its own).
    categories = (_label_names(federation.holdings[0]) if by_label
                  else [federation.tasks[holding.task].name for holding in federation.holdings])
    clients = {}
    for cid in range(federation.num_clients):
        counts = np.zeros(len(categories), dtype=np.int64)
        for position, holding in enumerate(federation.holdings):
            if cid not in holding.clients:
                continue
            train, _ = holding.split_of(cid)
            if by_label:
                counts += np.bincount(holding.dataset.labels[train], minlength=len(categories))
            else:
                counts[position] += len(train)
        clients[cid] = {**federation.sizes(cid), "counts": [int(count) for count in counts]}
    total = {key: sum(client[key] for client in clients.values()) for key in ("num_train", "num_test")}
    return {"by": "label" if by_label else "task", "categories": categories, "clients": clients, "total": total}


def _label_names(holding: Holding) -> list[str]:
    dataset = holding.dataset
    count = max(dataset.num_classes, int(dataset.labels.max()) + 1 if len(dataset.labels) else 0)
    return [dataset.class_names[label] if label < dataset.num_classes else str(label) for label in range(count)]


def format_summary(summary: dict[str, Any], max_rows: int = 40, max_columns: int = 12) -> str:
    """A fixed-width table, one line per client; past ``max_rows`` clients or ``max_columns`` categories the rest
    are left out (the clients) or summed into one ``other`` column (the categories), each with a note."""
    categories = list(summary["categories"])
    shown = categories if len(categories) <= max_columns else categories[: max_columns - 1] + ["other"]
    header = ["client", "train", "test", *(name if len(name) <= 12 else name[:11] + "." for name in shown)]

    def cells(name: str, train: int, test: int, counts: list[int]) -> list[str]:
        folded = counts if len(counts) == len(shown) else [*counts[: len(shown) - 1], sum(counts[len(shown) - 1:])]
        return [name, str(train), str(test), *map(str, folded)]

    clients = summary["clients"]
    rows = [cells(str(cid), c["num_train"], c["num_test"], c["counts"]) for cid, c in list(clients.items())[:max_rows]]
    totals = np.sum([c["counts"] for c in clients.values()], axis=0).tolist() if clients else [0] * len(categories)
    rows.append(cells("all", summary["total"]["num_train"], summary["total"]["num_test"], totals))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    if len(clients) > max_rows:
        lines.insert(-1, f"... {len(clients) - max_rows} more clients (every client is in the PNG)")
    notes = [f"{summary['by']} counts of each client's training samples"]
    if len(shown) < len(categories):
        notes.append(f"'other' sums the last {len(categories) - len(shown) + 1} of {len(categories)} {summary['by']}s")
    return "\n".join(lines) + "\n(" + "; ".join(notes) + ")"


def plot_summary(summary: dict[str, Any], path: str | os.PathLike) -> pathlib.Path:
    """A stacked bar per client of its training samples per category, saved as a PNG at ``path``."""
    clients = summary["clients"]
    counts = np.array([c["counts"] for c in clients.values()], dtype=np.int64).reshape(len(clients), -1)
    fig = Figure(figsize=(min(4 + 0.25 * len(clients), 24), 4.5), layout="constrained")
    ax = fig.subplots()
    positions = np.arange(len(clients))
    colors = matplotlib.colormaps["tab20"]
    bottom = np.zeros(len(clients), dtype=np.int64)
    for index, name in enumerate(summary["categories"]):
        ax.bar(positions, counts[:, index], bottom=bottom, width=0.85, label=name, color=colors(index % 20))
        bottom += counts[:, index]
    ax.set_xlabel("client")
    ax.set_ylabel("training samples")
    ax.set_title(f"Training samples per client, by {summary['by']}")
    step = max(1, len(clients) // 40)
    ax.set_xticks(positions[::step], [str(cid) for cid in list(clients)[::step]])
    if len(summary["categories"]) <= 20:
        ax.legend(title=summary["by"], fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save_figure(fig, path)
