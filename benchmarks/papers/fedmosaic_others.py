"""Where a method's Others score comes from in the offline PFL-Dynamic runs: each client's final model on every
other client's task, grouped by whether that task's client shares the client's task group and architecture.

    python benchmarks/papers/fedmosaic_others.py runs/fedmosaic/runs/* --out benchmarks/results/fedmosaic_others.json

Each argument is the run folder of a finished single-method job (``offline_runs``). A copy of it with
``data.stream.others_by_task`` on is resumed from its last checkpoint, which only runs the final evaluation (every
round has run), and that evaluation's ``others/<task>_<metric>`` values are grouped. The table (markdown, on
stdout) gives each method's mean over the runs per group.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from rayfed.io import atomic_write_json
from rayfed.results.report import format_table
from rayfed.simulation import Simulation

RELATIONS = ("same group, same architecture", "same group, other architecture", "other group, same architecture",
             "other group, other architecture")


def others_by_relation(run_dir: Path) -> dict[str, Any]:
    """One finished run's final Self / Others and its Others per relation (means over clients of their per-client
    means over the tasks of that relation)."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "run"
        shutil.copytree(run_dir, copy)
        config = yaml.safe_load((copy / "config.yaml").read_text())
        config["data"]["stream"]["others_by_task"] = True
        (copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (copy / "results" / f"{_label(config)}.json").unlink()  # else a resumed run skips the finished method
        Simulation.resume(copy, progress=False, check_model=False).run()
        final = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()][-1]
    if not final.get("final") or final.get("event") != "eval":
        raise ValueError(f"{run_dir}: the resumed run's last event is not its final evaluation")
    return {"run": run_dir.name, "label": _label(config), "seed": config["seed"],
            "self": final["self_token_f1"], "others": final["others_token_f1"],
            **by_relation(final["clients"], config, "token_f1")}


def by_relation(clients: dict[str, dict[str, float]], config: dict[str, Any], metric: str) -> dict[str, float]:
    """Per relation (:data:`RELATIONS`) between a client and the holder of another task: the mean over clients of
    each client's mean ``others/<task>_<metric>`` over the tasks of that relation (``config``: the run's, whose
    ``data.tasks`` name each task's client and ``options.group``, and ``architectures`` each one's clients)."""
    tasks = config["data"]["tasks"]
    owner = {task["name"]: task["clients"][0] for task in tasks}
    group_of = {task["clients"][0]: task["options"]["group"] for task in tasks}
    architecture = {cid: name for name, arch in config.get("architectures", {}).items() for cid in arch["clients"]}
    per_relation: dict[str, list[float]] = {relation: [] for relation in RELATIONS}
    prefix, suffix = "others/", f"_{metric}"
    for cid_text, metrics in clients.items():
        cid = int(cid_text)
        scores: dict[str, list[float]] = {relation: [] for relation in RELATIONS}
        for key, value in metrics.items():
            if key.startswith(prefix) and key.endswith(suffix):
                other = owner[key[len(prefix):-len(suffix)]]
                same_group = group_of[other] == group_of[cid]
                same_arch = architecture.get(other) == architecture.get(cid)
                scores[RELATIONS[(0 if same_group else 2) + (0 if same_arch else 1)]].append(value)
        for relation, values in scores.items():
            if values:
                per_relation[relation].append(statistics.mean(values))
    return {relation: statistics.mean(values) for relation, values in per_relation.items() if values}


def _label(config: dict[str, Any]) -> str:
    method = config["methods"][0]
    return method if isinstance(method, str) else method.get("label", method["name"])


def table(rows: list[dict[str, Any]]) -> str:
    labels = sorted({row["label"] for row in rows})
    columns = ("self", "others", *RELATIONS)
    body = []
    for label in labels:
        runs = [row for row in rows if row["label"] == label]
        body.append([label, str(len(runs)), *(f"{100 * statistics.mean(r[c] for r in runs):.1f}" for c in columns)])
    return format_table(body, ["method", "runs", "Self", "Others", *(f"Others: {r}" for r in RELATIONS)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="finished run folders of single-method offline_runs jobs")
    parser.add_argument("--out", required=True, help="JSON file for the per-run rows")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        rows.append(others_by_relation(Path(run)))
        print(json.dumps(rows[-1]), flush=True)
        atomic_write_json(Path(args.out), rows)
    print(table(rows))


if __name__ == "__main__":
    main()
