"""The trial table: one record per trial, best first, written as CSV and Markdown."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ray import tune as ray_tune

from rayfed.io import atomic_write_text

if TYPE_CHECKING:
    from rayfed.tune.sweep import _Sweep

TABLE_CSV = "trials.csv"
TABLE_MD = "trials.md"
BEST_FILE = "best.yaml"
PLOT_FILE = "metric_vs_params.png"


@dataclass(frozen=True)
class TrialRecord:
    """One row of the trial table."""

    trial_id: str
    params: dict[str, Any]
    metric: float | None
    rounds: int
    status: Literal["completed", "stopped early", "error"]
    run_dir: Path


@dataclass(frozen=True)
class SweepResult:
    """What a sweep wrote: the trial table (best first), the best trial and its ready-to-run config."""

    tune_dir: Path
    metric: str
    mode: str
    trials: list[TrialRecord]
    best: TrialRecord
    best_config: Path


def _record(sweep: _Sweep, result: ray_tune.Result) -> TrialRecord:
    metrics = result.metrics or {}
    trial_id = Path(result.path).name
    if result.error is not None:
        status = "error"
    else:
        status = "completed" if metrics.get("final") else "stopped early"
    return TrialRecord(
        trial_id=trial_id, params=_trial_params(sweep, result), metric=metrics.get(sweep.spec.metric),
        rounds=int(metrics.get("round", 0)), status=status, run_dir=sweep.runs_dir / trial_id,
    )


def _trial_params(sweep: _Sweep, result: ray_tune.Result) -> dict[str, Any]:
    """The trial's swept values. A trial that reported nothing (stopped by the sweep's time budget before its first
    round, or never started) has no config in its result: then Ray's ``params.json`` in its folder, if written."""
    params = result.config
    if params is None:
        params_file = Path(result.path) / "params.json"
        params = json.loads(params_file.read_text()) if params_file.is_file() else None
    return sweep.space.values(params) if params is not None else {}


def _ordered(records: list[TrialRecord], mode: str) -> list[TrialRecord]:
    """Best first: completed trials by metric, then stopped ones by metric, then errors."""
    rank = {"completed": 0, "stopped early": 1, "error": 2}

    def key(record: TrialRecord) -> tuple:
        value = record.metric
        missing = value is None or math.isnan(value)
        return rank[record.status], missing, 0.0 if missing else (-value if mode == "max" else value)

    return sorted(records, key=key)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value if isinstance(value, str) else json.dumps(value)


def _write_table(tune_dir: Path, sweep: _Sweep, records: list[TrialRecord]) -> None:
    header = ["trial", *sweep.space.paths, sweep.spec.metric, "round", "status"]
    rows = [[r.trial_id, *(r.params[p] for p in sweep.space.paths), r.metric, r.rounds, r.status] for r in records]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([[v if isinstance(v, (int, float, str)) or v is None else json.dumps(v) for v in row]
                      for row in rows])
    atomic_write_text(tune_dir / TABLE_CSV, buffer.getvalue())

    completed = [r for r in records if r.status == "completed"]
    lines = [
        f"# Sweep: {sweep.base['name']}",
        "",
        f"{len(records)} trials; {sweep.spec.mode} `{sweep.spec.metric}`; search {sweep.spec.search}, "
        f"scheduler {sweep.spec.scheduler.name}. `round`: the round the metric was measured at.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(_cell(v).replace("|", "\\|") or "—" for v in row) + " |" for row in rows),
        "",
    ]
    if completed:
        best = completed[0]
        lines += [f"Best: trial `{best.trial_id}`, {sweep.spec.metric} = {best.metric:.6g}; "
                  f"its config: [{BEST_FILE}]({BEST_FILE}).", "",
                  f"![metric against each swept value]({PLOT_FILE})", ""]
    atomic_write_text(tune_dir / TABLE_MD, "\n".join(lines))
