"""The trackers a config asks for, following a run (:class:`RunTracking`, fed by the run's results writer) or a
sweep (:class:`SweepTracking`, beside Ray Tune's own logger callbacks), with what a resumed run or sweep continues
kept in its folder's ``tracking.json``: each tracked run's id, and per method the last event each tracker got, so
that the events a resumed run makes again (those after its checkpoint) reach no tracker twice.

A tracker that fails (cannot be reached, refuses the credentials) is said once, in one sentence, and left out for
the rest of the run, which goes on; its files are complete.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rayfed.config import RunConfig
from rayfed.io import atomic_write_json
from rayfed.simulation.results import COUNT_KEYS, mean_std
from rayfed.tracking.protocol import RUN, Site, Tracker, first_line, flat

RECORD_FILE = "tracking.json"
TRACKERS = {"tensorboard": ("rayfed.tracking.tensorboard_run", "TensorBoardRun"),
            "wandb": ("rayfed.tracking.wandb_run", "WandbRun"), "mlflow": ("rayfed.tracking.mlflow_run", "MlflowRun")}
_ORDER = {"round": 0, "eval": 1}  # a method's events of one round come in this order, its final evaluation last


class _Following:
    """The trackers of one run or sweep, each built, opened, fed and closed under one guard."""

    def __init__(self, config: RunConfig, folder: Path, group: str, kind: str, say: Callable[[str], None]):
        config.tracking.check_installed()
        self.record_path, self.say = folder / RECORD_FILE, say
        self.record: dict[str, dict[str, Any]] = (json.loads(self.record_path.read_text())
                                                  if self.record_path.is_file() else {})
        self.hyperparameters = flat({key: value for key, value in config.to_dict().items() if key != "tracking"})
        self.trackers: dict[str, Tracker] = {}
        self.groups: dict[str, str] = {}
        for name in config.tracking.trackers:
            options = getattr(config.tracking, name)
            site = Site(getattr(options, "group", None) or group, config.name, folder, say, kind)
            module, cls = TRACKERS[name]
            tracker = self._guarded(name, "starting",
                                    lambda: getattr(importlib.import_module(module), cls)(options, site))
            if tracker is not None:
                self.trackers[name], self.groups[name] = tracker, site.group
                self.record.setdefault(name, {"ids": {}, "logged": {}})
        self.open_keys: dict[str, set[str]] = {name: set() for name in self.trackers}

    def _guarded(self, name: str, action: str, call: Callable[[], Any]) -> Any:
        """``call()``; if it fails, the tracker is said to have failed and is left out from now on."""
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - a tracker never stops the run
            self.trackers.pop(name, None)
            self.say(f"[rayfed] tracking.{name}: {action} failed ({first_line(err)}); the run goes on without it.")
            return None

    def _open(self, name: str, key: str, title: str, hyperparameters: dict[str, Any]) -> None:
        ids = self.record[name]["ids"]
        ids[key] = self.trackers[name].open(key, title, hyperparameters, ids.get(key))
        self.open_keys[name].add(key)
        self._save()

    def _open_own_run(self, trackers: Iterable[str]) -> None:
        """Open (or continue) the config's or sweep's own tracked run, named after its group, on ``trackers``."""
        for name in list(trackers):
            self._guarded(name, "opening its run",
                          lambda: self._open(name, RUN, self.groups[name], self.hyperparameters))

    def finish(self, files: list[Path]) -> None:
        """The run's (sweep's) files to its own tracked run, then every tracked run still open closed."""
        for name in list(self.trackers):
            if RUN in self.open_keys[name]:
                self._guarded(name, "attaching the results", lambda: self.trackers[name].attach(RUN, files))
        self.close(failed=False)

    def close(self, failed: bool) -> None:
        """Close every tracked run still open (``failed``: the run stopped on an error), the config's own last."""
        for name in list(self.trackers):
            for key in sorted(self.open_keys[name], key=lambda key: key == RUN):
                self._guarded(name, "closing its runs", lambda: self.trackers[name].close(key, failed))
            self.open_keys[name] = set()

    def _save(self) -> None:
        atomic_write_json(self.record_path, self.record)


class RunTracking(_Following):
    """A run's trackers: the config's tracked run opened at once, a method's on its first event, each event of
    ``metrics.jsonl`` logged at its round (:func:`event_values`), a method's run closed after its final evaluation."""

    def __init__(self, config: RunConfig, run_dir: Path, say: Callable[[str], None] = tqdm.write):
        super().__init__(config, run_dir, run_dir.name, "run", say)
        self.per_client = config.tracking.per_client
        recorded = config.to_dict()
        shared = flat({key: value for key, value in recorded.items() if key not in ("tracking", "methods", "tune")})
        self.method_hyperparameters = {entry["label"]: {**shared, **flat({"method": entry})}
                                       for entry in recorded["methods"]}
        self._open_own_run(self.trackers)

    def __call__(self, event: dict[str, Any]) -> None:
        """Log one event of metrics.jsonl to every tracker that has not had it."""
        if event.get("event") not in _ORDER:
            return
        label, step = event["method"], event["round"]
        position = [step, _ORDER[event["event"]] + bool(event.get("final"))]
        behind = [name for name in self.trackers
                  if label not in self.record[name]["logged"] or position > self.record[name]["logged"][label]]
        for name in behind:
            self._guarded(name, f"logging {label}'s round {step}", lambda: self._log(name, label, event, position))
        if behind:
            self._save()

    def replay(self, events: Iterable[dict[str, Any]]) -> None:
        """The events a resumed run starts from, to every tracker that has not had them (one that failed in the
        interrupted run, or was asked for since)."""
        for event in events:
            self(event)

    def _log(self, name: str, label: str, event: dict[str, Any], position: list[int]) -> None:
        tracker = self.trackers[name]
        if label not in self.open_keys[name]:
            self._open(name, label, label, self.method_hyperparameters[label])
        tracker.log(label, event["round"], event_values(event, self.per_client))
        self.record[name]["logged"][label] = position
        if event.get("final"):
            self.open_keys[name].discard(label)
            tracker.close(label, False)


class SweepTracking(_Following):
    """A sweep's trackers: Ray Tune's logger callback of each (every trial a tracked run in the sweep's group), and
    the sweep's own tracked run on the trackers that keep one (the trials' parent), which gets the sweep's results."""

    def __init__(self, config: RunConfig, tune_dir: Path, say: Callable[[str], None] = tqdm.write):
        super().__init__(config, tune_dir, tune_dir.parent.name, "sweep", say)
        self._open_own_run([name for name, tracker in self.trackers.items() if tracker.follows_sweeps])

    def callbacks(self) -> list[Any]:
        """Ray Tune's logger callbacks of the trackers."""
        made = [self._guarded(name, "starting Ray Tune's logger", self.trackers[name].tune_callback)
                for name in list(self.trackers)]
        return [callback for callback in made if callback is not None]


def event_values(event: dict[str, Any], per_client: bool) -> dict[str, float]:
    """What a tracker logs of an event of metrics.jsonl: a round's numbers as ``round/<key>`` (wall time, bytes up
    and down, the training loss, and whatever else the round counted) with its counts of participants, drop-outs and
    late clients; an evaluation's mean and spread over clients of each metric as ``eval/<metric>`` and
    ``eval_std/<metric>`` (``per_client``: each client's value as ``client/<id>/<metric>`` too)."""
    if event["event"] == "round":
        values = {f"round/{key}": value for key, value in event.items() if key != "round" and _is_number(value)}
        return {**values, **{f"round/{key}": len(event[key]) for key in ("participants", "dropped", "late")
                             if isinstance(event.get(key), list)}}
    clients = {int(client): metrics for client, metrics in event["clients"].items()}
    means, stds = mean_std(clients)
    values = {**{f"eval/{name}": value for name, value in means.items()},
              **{f"eval_std/{name}": value for name, value in stds.items()}}
    if per_client:
        values.update({f"client/{client}/{name}": value for client, metrics in sorted(clients.items())
                       for name, value in metrics.items() if name not in COUNT_KEYS and _is_number(value)})
    return values


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
