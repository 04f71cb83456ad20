"""What a run reports: ``metrics.jsonl`` (:class:`MetricsLog`), each method's results file and the run's summary, with
the means they hold (over clients, per task, per task kind, per architecture; a stream's A_last and A_AUC) and the
rounds each method took to reach a target accuracy."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rayfed.architectures import architecture_names, architecture_of
from rayfed.config import RunConfig
from rayfed.data.clients import Federation
from rayfed.io import atomic_write_text
from rayfed.results.derived_metrics import with_derived
from rayfed.data.streams import area_under_curve
from rayfed.tasks import Task, client_tasks
from rayfed.version import __version__

COUNT_KEYS = ("num_train", "num_test")


class MetricsLog:
    """``metrics.jsonl``: one JSON object per event; rewritten atomically when a restart drops events. Each appended
    event is handed to ``listener`` too (the run's trackers, :mod:`rayfed.tracking`)."""

    def __init__(self, path: Path, events: list[dict[str, Any]] | None = None,
                 listener: Callable[[dict[str, Any]], None] | None = None):
        self.path = path
        self.events = events or []
        self.listener = listener
        if events is not None:
            self._rewrite()

    @classmethod
    def read(cls, path: Path) -> list[dict[str, Any]]:
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def append(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        with self.path.open("a") as handle:
            handle.write(json.dumps(event) + "\n")
        if self.listener is not None:
            self.listener(event)

    def restart_method(self, label: str, from_round: int) -> None:
        """Forget ``label``'s events after ``from_round`` (they will be produced again)."""
        self.events = [
            e for e in self.events
            if e["method"] != label or (e["round"] <= from_round and not e.get("final"))
        ]
        self._rewrite()

    def _rewrite(self) -> None:
        atomic_write_text(self.path, "".join(json.dumps(e) + "\n" for e in self.events))


def method_results(config: RunConfig, federation: Federation, label: str, clients: Mapping[int, dict[str, float]],
                   nonfinite: dict[str, Any], events: list[dict[str, Any]],
                   counters: dict[str, float]) -> dict[str, Any]:
    """A method's results file: every client's final metrics, their mean and std, the groupings the run has (per
    task and task kind, a stream's summary, per architecture) and the communication and time it took."""
    means, stds = mean_std(clients)
    grouped = {}
    if len(federation.holdings) > 1:
        tasks_of = client_tasks(config.data)
        grouped = {"tasks": task_means(clients, tasks_of, federation.tasks),
                   "kinds": kind_means(clients, tasks_of, federation.tasks)}
    if config.data.stream is not None:
        grouped["stream"] = stream_summary(events, label)
    if config.architectures:
        of = architecture_of(config)
        grouped["architectures"] = {name: mean_std({c: m for c, m in clients.items() if of[c] == name})[0]
                                    for name in architecture_names(config)}
    return {
        "clients": {str(c): m for c, m in clients.items()}, "mean": means, "std": stds, **nonfinite, **grouped,
        "comm_bytes": {"up": int(counters["up_bytes"]), "down": int(counters["down_bytes"])},
        "comm_params": {"up": int(counters.get("up_params", 0)), "down": int(counters.get("down_params", 0))},
        "wall_time_s": counters["wall_time_s"],
    }


def run_summary(config: RunConfig, results_dir: Path, events: list[dict[str, Any]], wall_time_s: float,
                compute_match: dict[str, dict[str, float]],
                gpu_memory: dict[str, dict] | None = None) -> dict[str, Any]:
    """``summary.json``: every method's results file cut to its means and groupings, with the run's config,
    communication, rounds to the target accuracy, (``train.compute_match``) each method's measured cost and
    (``gpus_per_actor: measured``) each such architecture's GPU share and what it came from."""
    methods, comm, comm_params = {}, {}, {}
    for entry in config.methods:
        result = json.loads((results_dir / f"{entry.label}.json").read_text())
        methods[entry.label] = {"clients": result["clients"], "mean": result["mean"], "std": result["std"]}
        # per task, kind (the papers' Avg.), ...
        for group in ("nonfinite", "tasks", "kinds", "architectures", "stream"):
            if group in result:
                methods[entry.label][group] = result[group]
        comm[entry.label] = result["comm_bytes"]
        comm_params[entry.label] = result.get("comm_params", {"up": 0, "down": 0})
    post_trained = {entry.label for entry in config.methods if entry.post_train_steps}
    target, rounds = rounds_to_target(events, config.federation.target_acc, post_trained)
    return {
        "rayfed_version": __version__,
        "config": config.to_dict(),
        "methods": methods,
        "wall_time_s": round(wall_time_s, 3),
        "comm_bytes": comm,
        "comm_params": comm_params,  # "up" is the paper's T x M x P cost in parameters
        "target_acc": target,
        "rounds_to_target": rounds,
        **({"compute_match": compute_match} if compute_match else {}),
        **({"gpu_memory": gpu_memory} if gpu_memory else {}),
    }


def rounds_to_target(
    events: list[dict[str, Any]], target: float | None, post_trained: Collection[str] = (),
) -> tuple[float | None, dict[str, int | None]]:
    """The first evaluated round whose mean local_acc reaches ``target`` for every method (None: never).

    ``target`` defaults to 95% of the best mean local_acc any method reached at any evaluation. The
    final evaluation of a ``post_trained`` method (after its fine-tuning stage) is not a round's model
    and is left out."""
    evals = [
        e for e in events
        if e.get("event") == "eval" and "local_acc" in e and not (e.get("final") and e["method"] in post_trained)
    ]
    if target is None:
        if not evals:
            return None, {}
        target = 0.95 * max(e["local_acc"] for e in evals)
    rounds: dict[str, int | None] = {}
    for event in sorted(evals, key=lambda e: e["round"]):
        rounds.setdefault(event["method"], None)
        if rounds[event["method"]] is None and event["local_acc"] >= target:
            rounds[event["method"]] = event["round"]
    return target, rounds


def mean_std(clients: Mapping[int, dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean and std of every metric over the clients that report it as a finite number (each client counts once;
    NaN when none does): a non-finite value is left out, and the event or summary lists its clients."""
    names = list(dict.fromkeys(k for c in sorted(clients) for k in clients[c] if k not in COUNT_KEYS))
    values = {name: np.array([clients[c][name] for c in sorted(clients) if name in clients[c]], dtype=np.float64)
              for name in names}
    values = {name: v[np.isfinite(v)] for name, v in values.items()}
    means = with_derived({n: float(v.mean()) if len(v) else math.nan for n, v in values.items()})
    return means, {n: float(v.std()) if len(v) else math.nan for n, v in values.items()}


def stream_summary(events: list[dict[str, Any]], label: str) -> dict[str, dict[str, float]]:
    """A_last and A_AUC of every ``self_`` / ``others_`` mean: its value at the last evaluation and its mean over
    the evaluation points after round 0."""
    evaluations = sorted((e for e in events if e.get("event") == "eval" and e["method"] == label and e["round"] > 0),
                         key=lambda e: e["round"])
    names = dict.fromkeys(k for e in evaluations for k in e if k.startswith(("self_", "others_")))
    series = {name: [e[name] for e in evaluations if name in e] for name in names}
    return {name: {"a_last": values[-1], "a_auc": area_under_curve(values)}
            for name, values in series.items() if values}


def _own_metrics(metrics: dict[str, float], tasks: tuple[int, ...], task: Task) -> dict[str, float]:
    """A client's metrics of one of its tasks, under plain names: all of a single-task client's, else its
    ``<task>/...`` ones."""
    if len(tasks) == 1:
        return {name: value for name, value in metrics.items() if "/" not in name}
    prefix = f"{task.name}/"
    return {name[len(prefix):]: value for name, value in metrics.items() if name.startswith(prefix)}


def task_means(clients: Mapping[int, dict[str, float]], tasks_of: list[tuple[int, ...]],
               tasks: Iterable[Task]) -> dict[str, dict[str, float]]:
    """Per task, the mean of each metric over the clients holding it."""
    return {task.name: mean_std({c: _own_metrics(m, tasks_of[c], task) for c, m in clients.items()
                                 if task.index in tasks_of[c]})[0]
            for task in tasks if any(task.index in tasks_of[c] for c in clients)}


def kind_means(clients: Mapping[int, dict[str, float]], tasks_of: list[tuple[int, ...]],
               tasks: Iterable[Task]) -> dict[str, dict[str, float]]:
    """Per task kind, the mean of each ``local_`` metric over every (client, task) pair of that kind: the
    client-weighted "Avg." columns of the papers' tables."""
    pairs: dict[str, list[dict[str, float]]] = {}
    for task in tasks:
        for cid, metrics in clients.items():
            if task.index in tasks_of[cid]:
                own = {k: v for k, v in _own_metrics(metrics, tasks_of[cid], task).items() if k.startswith("local_")}
                pairs.setdefault(task.kind.name, []).append(own)
    return {kind: mean_std(dict(enumerate(rows)))[0] for kind, rows in pairs.items()}
