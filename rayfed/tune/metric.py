"""The tuned metric: checked against what runs report, and reported to Tune after each evaluation."""

from __future__ import annotations

from typing import Any

from ray import tune as ray_tune

from rayfed import registry
from rayfed.config import RunConfig
from rayfed.errors import ConfigError, suggest
from rayfed.results.derived_metrics import DERIVED
from rayfed.simulation import Simulation
from rayfed.tune.spec import TuneSpec


class _Reporter:
    """Simulation callback: report each evaluation of the tuned method to Tune (ASHA decides on these)."""

    def __init__(self, spec: TuneSpec):
        self.spec = spec

    def __call__(self, sim: Simulation, label: str, rounds_done: int) -> None:
        event = sim.log.events[-1]
        if label == self.spec.label and event["event"] == "eval" and event["round"] == rounds_done:
            ray_tune.report({self.spec.metric: _metric_of(self.spec, event), "round": rounds_done})


def _check_metric_name(spec: TuneSpec, config: RunConfig) -> None:
    """Refuse, before any trial starts, a metric name no run reports: less its view (``@<view>``), a reported
    name is a task kind's metric after a scope (``local_acc``, ``novel_acc``, ``others_token_f1``; the kinds of
    the config and every registered one), a derived metric (``hm``) or ``rep_shift``. Whether the method
    reports it is checked when it reports (:func:`_metric_of`)."""
    name = spec.metric_name.partition("@")[0]
    sections = (config.data, *(config.data.tasks or ()), config.data.public)
    named = [data.kind for data in sections if data is not None and data.kind is not None]
    kinds = ([entry.obj for entry in registry.entries("task_kind")]
             + [registry.resolve("task_kind", k).obj for k in named])
    tokens = {token for kind in kinds for token in (*kind.metrics, *kind.shared_metrics, kind.primary) if token}
    whole = {*DERIVED, "rep_shift"}
    if name in whole or any(name.endswith(f"_{token}") and len(name) > len(token) + 1 for token in tokens):
        return
    examples = sorted({f"local_{token}" for token in tokens} | whole)
    raise ConfigError(
        f"tune.metric = {spec.metric!r}: no run reports a metric {name!r}{suggest(name, examples)}; a metric is a "
        f"scope and a task kind's metric (local_acc, novel_acc, others_token_f1, ...), {', '.join(sorted(whole))}, "
        "each with @<view> for one of a method's views."
    )


def _metric_of(spec: TuneSpec, means: dict[str, Any]) -> float:
    if spec.metric_name not in means:
        reported = [k for k, v in means.items() if isinstance(v, float)]
        raise ConfigError(
            f"tune.metric = {spec.metric!r}: method {spec.label!r} reports no {spec.metric_name!r}"
            f"{suggest(spec.metric_name, reported)}; it reports {', '.join(reported)}."
        )
    return float(means[spec.metric_name])
