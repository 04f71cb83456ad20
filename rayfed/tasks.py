"""What a client learns: a task is a label space (class names) that a client's data is labelled in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    """One task of a run: ``index`` in the run's task list, a name, and the names of its classes."""

    index: int
    name: str
    class_names: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)
