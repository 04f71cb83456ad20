"""What every tracker does (:class:`Tracker`), where it does it (:class:`Site`), and the few things the trackers
share: the config as flat hyperparameters, and an error as a clause of a sentence."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

RUN = ""
"""The key of the config's own tracked run (a sweep's: the sweep's), which holds every method's (trial's) run."""


@dataclass(frozen=True)
class Site:
    """Where a tracker follows a run or a sweep: the group its runs share (its options' group, else the run's or
    sweep's folder name; also the name of the config's own tracked run), the project or experiment they go to unless
    the options name one (the config's name), the folder its local files go to unless the options name one, how it
    tells the user something (one sentence), and what it follows (a run or a sweep)."""

    group: str
    project: str
    folder: Path
    say: Callable[[str], None]
    kind: Literal["run", "sweep"] = "run"


class Tracker(Protocol):
    """One tracker: tracked runs it opens, logs to and closes, by key (:data:`RUN` or a method's label)."""

    name: ClassVar[str]
    follows_sweeps: ClassVar[bool]  # whether it keeps a run of its own for a sweep, beside Tune's runs of the trials

    def open(self, key: str, title: str, hyperparameters: dict[str, Any], kept: str | None) -> str:
        """Start tracked run ``key`` named ``title`` with ``hyperparameters``, or, with ``kept`` (what this returned
        before), continue it; return what continues it."""

    def log(self, key: str, step: int, values: dict[str, float]) -> None:
        """The values of round ``step``."""

    def attach(self, key: str, files: list[Path]) -> None:
        """Files of the finished run: figures (PNG) as images, the others (summary.json, report.md) as files."""

    def close(self, key: str, failed: bool) -> None:
        """End tracked run ``key``."""

    def tune_callback(self) -> Any:
        """Ray Tune's own logger callback for this tracker, configured as it is (each trial a run in its group)."""


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"train.lr": 0.01, "methods.0.name": "fedavg", ...}``; an empty mapping or list stays a
    value of its own."""
    if isinstance(value, dict) and value:
        items = value.items()
    elif isinstance(value, (list, tuple)) and value:
        items = enumerate(value)
    else:
        return {prefix.removesuffix("."): value}
    return {name: leaf for key, item in items for name, leaf in flat(item, f"{prefix}{key}.").items()}


def first_line(err: BaseException) -> str:
    """An error as a clause of a sentence: its type and the first line of its message."""
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0].rstrip('.')}" if message else type(err).__name__
