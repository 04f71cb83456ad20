"""Metrics computed from other metrics, per client and over client means.

A derived metric of the client means is computed from the means of its parts, not averaged over
clients: ``hm`` (of a base-to-novel evaluation) is the harmonic mean of the client-averaged ``local_acc``,
``base_acc`` and ``novel_acc``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DERIVED: dict[str, tuple[str, ...]] = {"hm": ("local_acc", "base_acc", "novel_acc")}


def harmonic_mean(values: Sequence[float]) -> float:
    """``n / sum(1 / v)``; 0 when any value is 0."""
    if any(v <= 0 for v in values):
        return 0.0
    return len(values) / sum(1.0 / v for v in values)


def with_derived(metrics: Mapping[str, float]) -> dict[str, float]:
    """``metrics`` plus every derived metric whose parts are all present (recomputed from them)."""
    out = dict(metrics)
    for name, parts in DERIVED.items():
        if all(part in metrics for part in parts):
            out[name] = harmonic_mean([metrics[part] for part in parts])
    return out


def across_datasets(means: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The paper's "average over datasets" row from per-dataset client means: the arithmetic mean of
    every metric, ``hm`` included (the mean of per-dataset HMs, not the HM of the averages)."""
    rows = list(means.values())
    names = [name for name in rows[0] if all(name in row for row in rows)]
    return {name: sum(row[name] for row in rows) / len(rows) for name in names}
