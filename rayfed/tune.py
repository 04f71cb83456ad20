"""Hyperparameter sweeps with Ray Tune: ``rayfed tune CONFIG`` and :func:`tune`.

A sweep is an ordinary run config plus a ``tune:`` section. Every trial is one
:class:`~rayfed.simulation.Simulation` of the config with the trial's values filled in::

    tune:
      metric: fedavg/local_acc        # LABEL/METRIC: a summary mean of one method (local_acc, hm, ...)
      mode: max                       # max | min
      num_samples: 8                  # random: samples (per point of any grid); grid: repeats of the grid
      search: random                  # random | grid | optuna (optuna: when installed)
      scheduler: {name: asha, grace_period: 2, reduction_factor: 2}   # or: fifo
      max_concurrent_trials: 4
      max_failures: 0                 # Tune retries of a failed trial (each continues from its checkpoints)
      space:                          # dotted config path -> search space
        train.lr: {loguniform: [1.0e-4, 1.0e-1]}
        train.local_steps: {choice: [5, 10, 20]}
        federation.rounds: {grid: [10, 20]}
        methods.0.lam: {uniform: [0.01, 1.0]}       # a method hyperparameter, by method index
        model.lora.rank: {randint: [2, 9]}          # integers in [2, 9), as in Ray Tune

Search spaces: ``grid: [v, ...]`` (every value, crossed with the other grids), ``choice: [v, ...]``,
``uniform: [low, high]``, ``loguniform: [low, high]`` and ``randint: [low, high]`` (``high``
excluded). ``grid``/``choice`` values may be lists or mappings, e.g. whole per-task vectors. A
*list* is a per-task vector whose elements are searched independently: each element is a
search space or a fixed value. Every path and every representative value (each grid/choice
value, the bounds and midpoint of a range) is checked against the config schema before any
trial starts, and bad entries are reported in one sentence naming ``tune.space.<path>``.

Any field a method's ``Params`` dataclass declares is ``methods.<index>.<name>``, so the paper
sweeps are one YAML each once the methods exist (``methods/tap.py``, ``methods/fedmosaic.py``;
the hyperparameter names below are the specs' and must match those dataclasses):

TAP (per-task replacement margins and the KD temperature)::

    methods: [{name: tap, margins: [0.01, 0.005, 0.005, 0.01], kd_temperature: 1.0}]
    tune:
      metric: tap/local_acc
      space:
        methods.0.margins: {choice: [[0.005, 0.0025, 0.0025, 0.005], [0.01, 0.005, 0.005, 0.01],
                                     [0.02, 0.01, 0.01, 0.02], [0.04, 0.02, 0.02, 0.04]]}
        methods.0.kd_temperature: {grid: [0.5, 1.0, 2.0]}
    # or each task's margin on its own:  methods.0.margins: [{loguniform: [0.001, 0.1]}, 0.005, ...]

FedMosaic (RELA temperature tau and the number of PQ-LoRA blocks N_B)::

    methods: [{name: fedmosaic, tau: 0.5, n_blocks: 4}]
    tune:
      metric: fedmosaic/others_acc
      search: grid
      space:
        methods.0.tau: {grid: [0.02, 0.1, 0.25, 0.5, 1.0, 2.0, 10.0]}
        methods.0.n_blocks: {grid: [2, 4, 8]}
        seed: {grid: [0, 1, 2]}

pFedMMA's ``alpha`` / ``rank`` / ``layer`` are swept the same way (``methods.0.alpha: {loguniform:
[1.0e-4, 1.0e-2]}``).

Execution: each trial runs inside its own placement group (:func:`trial_resources`): bundle 0
holds the trial's round loop and the DriverActor, bundle ``i + 1`` ClientActor ``i``, so
concurrent trials pack onto a cluster without oversubscribing (fractional) GPUs; with
``placement.executor: local`` the trial's own process runs every actor, in one bundle. Every
evaluation (``federation.eval_every``) is reported to Tune with its ``round``, which is ASHA's
time axis, and the run's final summary is the trial's last report. The trial's run directory
(``tune/runs/<trial_id>/``, a normal rayfed run) is its checkpoint: with
``federation.checkpoint_every`` set, a trial that Tune restarts (``rayfed tune --resume`` or a
``max_failures`` retry) continues from its last engine checkpoint with :meth:`Simulation.resume`
and ends with the same numbers as an uninterrupted trial. On a multi-node cluster the output
directory must be on a filesystem every node sees (as Ray Tune requires of a local
``storage_path``).

Results, in ``runs/<name>/tune/`` (or ``--out DIR``/tune): ``trials.csv`` and ``trials.md`` (every
trial: swept values, metric, round of the metric, status), ``best.yaml`` (the best completed
trial's full config, ready for ``rayfed run``), ``metric_vs_params.png``, ``sweep.yaml`` (the
sweep itself, read by ``--resume``), ``runs/`` (one run directory per trial) and ``experiment/``
(Ray Tune's state).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import functools
import io
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pydantic
import ray
import yaml
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import tune as ray_tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from rayfed import registry
from rayfed.architectures import actor_slots
from rayfed.config import RunConfig, apply_overrides, build_config, dump_config, load_config
from rayfed.errors import ConfigError, choice_error, suggest
from rayfed.io import atomic_write_bytes, atomic_write_text
from rayfed.method import build_method
from rayfed.metrics import DERIVED
from rayfed.simulation import RoundCallback, Simulation, import_plugin_modules, init_ray, ship_by_value

__all__ = [
    "SchedulerSpec", "SearchSpace", "SweepResult", "TrialRecord", "TuneSpec", "resume", "trial_resources", "tune",
]

SPACE_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
TRIAL_DRIVER_CPUS = 0.25
"""Smallest CPU share of bundle 0, where a trial's round loop runs next to its DriverActor."""

TUNE_DIR = "tune"
SWEEP_FILE = "sweep.yaml"
EXPERIMENT_DIR = "experiment"
RUNS_DIR = "runs"
TABLE_CSV = "trials.csv"
TABLE_MD = "trials.md"
BEST_FILE = "best.yaml"
PLOT_FILE = "metric_vs_params.png"
_UNSWEEPABLE = {"tune": "a sweep cannot sweep its own tune section",
                "ray": "trials share the sweep's Ray cluster"}


# The tune: section --------------------------------------------------------------------------
class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulerSpec(_Section):
    """``fifo`` runs every trial to the end; ``asha`` stops trials whose evaluations fall behind."""

    name: Literal["fifo", "asha"] = "fifo"
    grace_period: int | None = Field(None, gt=0, description="asha: rounds before a trial may be stopped (default 1)")
    reduction_factor: float | None = Field(None, gt=1, description="asha: keep the best 1/reduction_factor (default 4)")
    max_t: int | None = Field(None, gt=0, description="asha: last rung (default: the most rounds a trial runs)")

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, raw: Any) -> Any:
        return {"name": raw} if isinstance(raw, str) else raw

    @model_validator(mode="after")
    def _asha_options(self) -> SchedulerSpec:
        if self.name == "fifo":
            for option in ("grace_period", "reduction_factor", "max_t"):
                if getattr(self, option) is not None:
                    raise ValueError(f"tune.scheduler.{option} applies to the asha scheduler only, not to fifo")
        return self


class TuneSpec(_Section):
    """The validated ``tune:`` section of a run config."""

    metric: str = Field(description="LABEL/METRIC, e.g. fedavg/local_acc")
    mode: Literal["max", "min"] = "max"
    space: dict[str, Any] = Field(min_length=1)
    num_samples: int = Field(1, gt=0)
    search: Literal["random", "grid", "optuna"] = "random"
    scheduler: SchedulerSpec = SchedulerSpec()
    max_concurrent_trials: int | None = Field(None, gt=0)
    max_failures: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _metric_form(self) -> TuneSpec:
        label, _, name = self.metric.rpartition("/")
        if not label or not name:
            raise ValueError(
                f"tune.metric = {self.metric!r} must name a method and a metric as LABEL/METRIC, "
                "e.g. 'fedavg/local_acc'"
            )
        return self

    @property
    def label(self) -> str:
        return self.metric.rpartition("/")[0]

    @property
    def metric_name(self) -> str:
        return self.metric.rpartition("/")[2]


def _parse_spec(raw: Any) -> TuneSpec:
    if raw is None:
        raise ConfigError("rayfed tune needs a `tune:` section in the config (its fields are listed in rayfed.tune).")
    try:
        return TuneSpec.model_validate(raw)
    except pydantic.ValidationError as err:
        first = err.errors()[0]
        loc = tuple(str(part) for part in first["loc"])
        path = ".".join(("tune", *loc))
        if first["type"] == "extra_forbidden":
            allowed = list((SchedulerSpec if loc[0] == "scheduler" else TuneSpec).model_fields)
            raise ConfigError(
                f"unknown tune field {path!r}{suggest(loc[-1], allowed)}; allowed here: {', '.join(allowed)}."
            ) from None
        if first["type"] == "missing":
            raise ConfigError(f"{path} is missing; it is required.") from None
        message = first["msg"].removeprefix("Value error, ").rstrip(".")
        if first["type"] == "value_error":  # our own checks name their field already
            raise ConfigError(message + ".") from None
        raise ConfigError(f"{path} = {first.get('input')!r} is invalid: {message}.") from None


# Search spaces ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Leaf:
    """One searched value: Tune's parameter ``key`` drawn from ``kind`` over ``args``."""

    key: str
    kind: str
    args: tuple[Any, ...]

    @property
    def indexed(self) -> bool:
        # Lists and mappings go to Tune (and Optuna) as indices into the values, decoded in the trial.
        return self.kind in ("grid", "choice") and not all(_is_scalar(v) for v in self.args)

    def domain(self, search: str) -> Any:
        if self.kind in ("grid", "choice"):
            values = list(range(len(self.args))) if self.indexed else list(self.args)
            if self.kind == "grid" or search == "grid":
                return ray_tune.grid_search(values)
            return ray_tune.choice(values)
        return {"uniform": ray_tune.uniform, "loguniform": ray_tune.loguniform,
                "randint": ray_tune.randint}[self.kind](*self.args)

    def decode(self, sampled: Any) -> Any:
        return self.args[sampled] if self.indexed else sampled

    def representatives(self) -> list[Any]:
        """Values checked against the config before launching: a grid/choice's all, a range's bounds and middle."""
        if self.kind in ("grid", "choice"):
            return list(self.args)
        low, high = self.args
        if self.kind == "uniform":
            return [low, (low + high) / 2, high]
        if self.kind == "loguniform":
            return [low, math.sqrt(low * high), high]
        return sorted({low, (low + high - 1) // 2, high - 1})


@dataclass(frozen=True)
class _Swept:
    """One swept config path: a single leaf, or a per-task vector of leaves and fixed values."""

    path: str
    parts: tuple[Any, ...]
    vector: bool

    @property
    def leaves(self) -> list[_Leaf]:
        return [part for part in self.parts if isinstance(part, _Leaf)]

    def value(self, params: dict[str, Any]) -> Any:
        """The config value for Tune's parameters of one trial."""
        return self._assemble({leaf.key: leaf.decode(params[leaf.key]) for leaf in self.leaves})

    def variations(self) -> Iterator[Any]:
        """Config values with every leaf's representatives in turn, the other leaves at their first."""
        first = {leaf.key: leaf.representatives()[0] for leaf in self.leaves}
        for leaf in self.leaves:
            for value in leaf.representatives():
                yield self._assemble({**first, leaf.key: value})

    def _assemble(self, leaf_values: dict[str, Any]) -> Any:
        values = [leaf_values[part.key] if isinstance(part, _Leaf) else part for part in self.parts]
        return values if self.vector else values[0]

    @property
    def log_scale(self) -> bool:
        return not self.vector and self.parts[0].kind == "loguniform"


class SearchSpace:
    """The ``tune.space`` mapping, parsed: Tune's parameter space and the mapping back to config values."""

    def __init__(self, raw: dict[str, Any], search: str):
        self.search = search
        self.swept = [_parse_swept(str(path), spec) for path, spec in raw.items()]
        for swept in self.swept:
            for leaf in swept.leaves:
                _check_leaf_for_search(swept.path, leaf, search)

    @property
    def paths(self) -> list[str]:
        return [swept.path for swept in self.swept]

    def param_space(self) -> dict[str, Any]:
        return {leaf.key: leaf.domain(self.search) for swept in self.swept for leaf in swept.leaves}

    def values(self, params: dict[str, Any]) -> dict[str, Any]:
        """Config path -> value for one trial's Tune parameters."""
        return {swept.path: swept.value(params) for swept in self.swept}

    def first_values(self) -> dict[str, Any]:
        return {swept.path: next(swept.variations()) for swept in self.swept}

    def log_scale(self, path: str) -> bool:
        return next(swept for swept in self.swept if swept.path == path).log_scale


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _parse_swept(path: str, spec: Any) -> _Swept:
    where = f"tune.space.{path}"
    keys = path.split(".")
    if not all(keys):
        raise ConfigError(f"{where} is not a dotted config path like train.lr or methods.0.margins.")
    if keys[0] in _UNSWEEPABLE:
        raise ConfigError(f"{where}: the {keys[0]} section cannot be swept ({_UNSWEEPABLE[keys[0]]}).")
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where} = [] is an empty per-task vector; give one search space or value per task.")
        parts = tuple(
            _parse_leaf(f"{path}.{index}", element, f"{where}[{index}]") if isinstance(element, dict) else element
            for index, element in enumerate(spec)
        )
        if not any(isinstance(part, _Leaf) for part in parts):
            raise ConfigError(
                f"{where} = {spec!r} holds no search space; put fixed values in the config itself, "
                "or write an element as e.g. {uniform: [0.0, 0.1]}."
            )
        return _Swept(path, parts, vector=True)
    if isinstance(spec, dict):
        return _Swept(path, (_parse_leaf(path, spec, where),), vector=False)
    raise ConfigError(
        f"{where} = {spec!r} is not a search space; write one of {', '.join(f'{{{k}: ...}}' for k in SPACE_KINDS)}, "
        "or a list of those and fixed values for a per-task vector."
    )


def _parse_leaf(key: str, spec: dict[str, Any], where: str) -> _Leaf:
    if len(spec) != 1:
        raise ConfigError(
            f"{where} = {spec!r} must have exactly one of {', '.join(SPACE_KINDS)} (e.g. {{choice: [1, 2]}})."
        )
    kind, args = next(iter(spec.items()))
    if kind not in SPACE_KINDS:
        raise choice_error(where, kind, SPACE_KINDS)
    if kind in ("grid", "choice"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.{kind} = {args!r} must be a non-empty list of values.")
        return _Leaf(key, kind, tuple(args))
    numeric = isinstance(args, list) and len(args) == 2 and all(
        isinstance(a, (int, float)) and not isinstance(a, bool) for a in args
    )
    if not numeric:
        raise ConfigError(f"{where}.{kind} = {args!r} must be [low, high], two numbers.")
    low, high = args
    if not low < high:
        raise ConfigError(f"{where}.{kind} = {args!r} needs low < high.")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"{where}.loguniform = {args!r} needs low > 0 (a log scale has no zero).")
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        raise ConfigError(f"{where}.randint = {args!r} needs integer bounds.")
    return _Leaf(key, kind, (low, high))


def _check_leaf_for_search(path: str, leaf: _Leaf, search: str) -> None:
    if search == "grid" and leaf.kind not in ("grid", "choice"):
        raise ConfigError(
            f"tune.space.{path} is {leaf.kind}, which grid search cannot enumerate; use grid or choice values, "
            "or tune.search: random."
        )
    if search == "optuna" and leaf.kind == "grid":
        raise ConfigError(
            f"tune.space.{path} is a grid, which Optuna does not search; use choice with tune.search: optuna."
        )


# Sweep: the validated config, space and metric ----------------------------------------------
@dataclass(frozen=True)
class _Sweep:
    """Everything a trial needs, shipped to the trial processes."""

    base: dict[str, Any]
    spec: TuneSpec
    space: SearchSpace
    runs_dir: Path
    callbacks: tuple[RoundCallback, ...]
    max_rounds: int
    trial_needs: dict[str, float]
    plugins: tuple[registry.Entry, ...] = ()  # what the driver registered, installed in every trial's process

    @classmethod
    def build(cls, config: RunConfig, tune_dir: Path, callbacks: list[RoundCallback] | None) -> _Sweep:
        spec = _parse_spec(config.tune)
        labels = [entry.label for entry in config.methods]
        if spec.label not in labels:
            raise ConfigError(
                f"tune.metric = {spec.metric!r} names no method of the config{suggest(spec.label, labels)}; "
                f"allowed labels: {', '.join(labels)} (write LABEL/METRIC, e.g. {labels[0]}/local_acc)."
            )
        _check_metric_name(spec, config)
        if spec.search == "optuna":
            try:
                import optuna  # noqa: F401
            except ImportError:
                raise ConfigError("tune.search = 'optuna' needs the optuna package (pip install optuna); "
                                  "without it use random or grid.") from None
        base = config.to_dict()
        space = SearchSpace(spec.space, spec.search)
        configs = _checked_configs(base, space)
        max_rounds = max(c.federation.rounds for c in configs)
        needs = [trial_resources(c).required_resources for c in configs]
        trial_needs = {resource: max(n.get(resource, 0.0) for n in needs) for resource in ("CPU", "GPU")}
        asha = spec.scheduler
        last_rung = asha.max_t or max_rounds
        if asha.name == "asha" and asha.grace_period is not None and asha.grace_period > last_rung:
            raise ConfigError(
                f"tune.scheduler.grace_period = {asha.grace_period} is more than the {last_rung} rounds "
                "a trial runs; it must be at most that."
            )
        plugins = tuple(registry.user_entries())
        ship_by_value(entry.obj for entry in plugins)
        return cls(base, spec, space, tune_dir / RUNS_DIR, tuple(callbacks or ()), max_rounds, trial_needs, plugins)

    def check_cluster(self) -> None:
        """A trial larger than the whole cluster would wait forever: say so instead."""
        available = ray.cluster_resources()
        for resource, needed in self.trial_needs.items():
            if needed > available.get(resource, 0.0) + 1e-9:
                raise ConfigError(
                    f"placement: one trial's placement group needs {needed:g} {resource} (the DriverActor's bundle "
                    f"plus one per ClientActor) but the Ray cluster has {available.get(resource, 0.0):g}; raise "
                    f"placement.clients_per_actor or lower placement.{resource.lower()}s_per_actor."
                )

    def trial_config(self, values: dict[str, Any]) -> RunConfig:
        """The run config of one trial, given config path -> value."""
        return _trial_config(self.base, values)

    # Ray Tune objects ----------------------------------------------------------------------
    def trainable(self) -> Any:
        trainable = ray_tune.with_parameters(_run_trial, sweep=self)
        return ray_tune.with_resources(trainable, resources=functools.partial(_trial_resources_for, self))

    def tune_config(self) -> ray_tune.TuneConfig:
        spec, seed = self.spec, self.base["seed"]
        if spec.search == "optuna":
            from ray.tune.search.optuna import OptunaSearch

            search_alg, max_concurrent = OptunaSearch(seed=seed), spec.max_concurrent_trials
        else:
            from ray.tune.search import BasicVariantGenerator

            # Tune ignores max_concurrent_trials for a generator instance: it takes the limit itself.
            search_alg = BasicVariantGenerator(random_state=seed, max_concurrent=spec.max_concurrent_trials or 0)
            max_concurrent = None
        if spec.scheduler.name == "asha":
            scheduler = ASHAScheduler(
                time_attr="round", max_t=spec.scheduler.max_t or self.max_rounds,
                grace_period=spec.scheduler.grace_period or 1, reduction_factor=spec.scheduler.reduction_factor or 4,
            )
        else:
            scheduler = FIFOScheduler()
        return ray_tune.TuneConfig(
            metric=spec.metric, mode=spec.mode, search_alg=search_alg, scheduler=scheduler,
            num_samples=spec.num_samples, max_concurrent_trials=max_concurrent,
            trial_dirname_creator=_trial_dirname,
            # A finished trial's process (torch already imported) runs the next trial; a stopped trial's
            # Simulation unwinds first (Tune ends it inside tune.report), killing its actors.
            reuse_actors=True,
        )

    def run_config(self, tune_dir: Path, verbose: int) -> ray_tune.RunConfig:
        return ray_tune.RunConfig(
            name=EXPERIMENT_DIR, storage_path=str(tune_dir), verbose=verbose,
            failure_config=ray_tune.FailureConfig(max_failures=self.spec.max_failures),
        )


def _trial_config(base: dict[str, Any], values: dict[str, Any]) -> RunConfig:
    raw = copy.deepcopy(base)
    raw["tune"] = None
    # safe_dump writes values in the form apply_overrides' YAML parsing reads back unchanged (e.g. 1.0e-07).
    overrides = [f"{path}={yaml.safe_dump(value, default_flow_style=True)}" for path, value in values.items()]
    config = build_config(apply_overrides(raw, overrides))
    for index, entry in enumerate(config.methods):  # the methods' hyperparameters, as each trial will build them
        build_method(entry, index)
    return config


def _checked_configs(base: dict[str, Any], space: SearchSpace) -> list[RunConfig]:
    """Build the config with each path's representative values; an error names the swept path."""
    configs = []
    first = space.first_values()
    for swept in space.swept:
        for value in swept.variations():
            for values in ({swept.path: value}, {**first, swept.path: value}):
                try:
                    configs.append(_trial_config(base, values))
                except ConfigError as err:
                    others = {p: v for p, v in values.items() if p != swept.path}
                    context = f", with {_format_values(others)}," if others else ""
                    raise ConfigError(
                        f"tune.space.{swept.path} = {value!r}{context} does not fit the config: {err}"
                    ) from None
    return configs


def _format_values(values: dict[str, Any]) -> str:
    return ", ".join(f"{path} = {value!r}" for path, value in values.items())


def _trial_dirname(trial: Any) -> str:
    return trial.trial_id


def trial_resources(config: RunConfig) -> ray_tune.PlacementGroupFactory:
    """The placement group of one trial of ``config``: the DriverActor's bundle, then one per ClientActor.

    The head bundle is empty, so Tune runs the trial function itself in bundle 0 without
    reserving anything for it, next to the DriverActor; bundle ``i + 1`` is ClientActor ``i``
    (the layout ``rayfed.simulation._placed`` uses). With ``placement.executor: local`` the trial's
    own process runs every actor, one after another: one bundle, as large as the largest actor's.
    """
    placement = config.placement
    slots = actor_slots(config)
    if placement.executor == "local":
        cpus = max(placement.driver_cpus, TRIAL_DRIVER_CPUS, *(slot.cpus for slot in slots))
        gpus = max(slot.gpus for slot in slots)
        return ray_tune.PlacementGroupFactory([{"CPU": cpus, "GPU": gpus} if gpus else {"CPU": cpus}])
    client_bundles = [{"CPU": slot.cpus, "GPU": slot.gpus} for slot in slots]
    return ray_tune.PlacementGroupFactory(
        [{}, {"CPU": max(placement.driver_cpus, TRIAL_DRIVER_CPUS)}, *client_bundles],
        strategy="SPREAD" if placement.strategy == "SPREAD" else "PACK",
    )


def _trial_resources_for(sweep: _Sweep, params: dict[str, Any]) -> ray_tune.PlacementGroupFactory:
    return trial_resources(sweep.trial_config(sweep.space.values(params)))


# The trial ------------------------------------------------------------------------------------
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
    kinds = [entry.obj for entry in registry.entries("task_kind")] + [registry.resolve("task_kind", k).obj for k in named]
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


def _run_trial(params: dict[str, Any], sweep: _Sweep) -> None:
    registry.install(sweep.plugins)
    run_dir = sweep.runs_dir / ray_tune.get_context().get_trial_id()
    callbacks = [*sweep.callbacks, _Reporter(sweep.spec)]  # the reporter last: a stopped trial ends inside it
    if (run_dir / "config.yaml").is_file():  # Tune restarted this trial: continue from its engine checkpoints
        sim = Simulation.resume(run_dir, callbacks=callbacks, progress=False)
    else:
        config = sweep.trial_config(sweep.space.values(params))
        sim = Simulation(config, out_dir=run_dir, callbacks=callbacks, progress=False)
    summary = sim.run()
    means = summary["methods"][sweep.spec.label]["mean"]
    ray_tune.report({sweep.spec.metric: _metric_of(sweep.spec, means),
                     "round": sim.config.federation.rounds, "final": True})


# Public API -----------------------------------------------------------------------------------
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


def tune(
    config: RunConfig | dict | str | os.PathLike,
    *,
    overrides: list[str] | None = None,
    out_dir: str | os.PathLike | None = None,
    callbacks: list[RoundCallback] | None = None,
    verbose: int = 1,
) -> SweepResult:
    """Run the sweep declared in ``config``'s ``tune:`` section; write results to ``<out_dir or runs/<name>>/tune``.

    ``callbacks`` run in every trial's Simulation (in the trial processes), each round before the
    report to Tune, so they also see the round at which a scheduler stops a trial.
    ``verbose`` is Ray Tune's (0 silent, 1 status, 2 with every result).
    """
    run_config = load_config(config, overrides)
    import_plugin_modules(run_config)
    tune_dir = _fresh_tune_dir(run_config.name, out_dir)
    sweep = _Sweep.build(run_config, tune_dir, callbacks)
    with _ray(run_config):
        sweep.check_cluster()
        tune_dir.mkdir(parents=True, exist_ok=True)
        dump_config(run_config, tune_dir / SWEEP_FILE)
        tuner = ray_tune.Tuner(
            sweep.trainable(), param_space=sweep.space.param_space(),
            tune_config=sweep.tune_config(), run_config=sweep.run_config(tune_dir, verbose),
        )
        return _finish(sweep, tune_dir, _fit(tuner))


def resume(run_dir: str | os.PathLike, *, callbacks: list[RoundCallback] | None = None) -> SweepResult:
    """Continue the sweep in ``run_dir`` (or ``run_dir/tune``): unfinished and errored trials go on from checkpoints.

    Tune keeps the sweep's own settings (e.g. its verbosity); ``callbacks`` as for :func:`tune`.
    """
    tune_dir = _existing_tune_dir(run_dir)
    run_config = load_config(tune_dir / SWEEP_FILE)
    import_plugin_modules(run_config)
    sweep = _Sweep.build(run_config, tune_dir, callbacks)
    with _ray(run_config):
        sweep.check_cluster()
        tuner = ray_tune.Tuner.restore(
            str(tune_dir / EXPERIMENT_DIR), trainable=sweep.trainable(),
            resume_unfinished=True, resume_errored=True,
        )
        return _finish(sweep, tune_dir, _fit(tuner))


@contextlib.contextmanager
def _ray(config: RunConfig) -> Iterator[None]:
    owns_ray = init_ray(config)
    try:
        yield
    finally:
        if owns_ray:
            ray.shutdown()


def _fit(tuner: ray_tune.Tuner) -> ray_tune.ResultGrid:
    # Tune's trial processes otherwise chdir into a scratch folder; keeping Ray's worker directory makes
    # relative data/model paths resolve the same in a trial's round loop as in its actors.
    previous = os.environ.get("RAY_CHDIR_TO_TRIAL_DIR")
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    try:
        return tuner.fit()
    finally:
        if previous is None:
            del os.environ["RAY_CHDIR_TO_TRIAL_DIR"]
        else:
            os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = previous


def _fresh_tune_dir(name: str, out_dir: str | os.PathLike | None) -> Path:
    if out_dir is not None:
        tune_dir = Path(out_dir) / TUNE_DIR
        if tune_dir.exists():
            raise ConfigError(
                f"--out {str(out_dir)!r} already holds a sweep; pass --resume {str(out_dir)!r} to continue it, "
                "or choose another --out (nothing there is overwritten)."
            )
        return tune_dir.resolve()
    base = Path("runs") / name
    path, suffix = base, 1
    while (path / TUNE_DIR).exists():
        suffix += 1
        path = base.with_name(f"{base.name}-{suffix}")
    return (path / TUNE_DIR).resolve()


def _existing_tune_dir(run_dir: str | os.PathLike) -> Path:
    for candidate in (Path(run_dir) / TUNE_DIR, Path(run_dir)):
        if (candidate / SWEEP_FILE).is_file() and (candidate / EXPERIMENT_DIR).is_dir():
            return candidate.resolve()
    raise ConfigError(
        f"--resume {str(run_dir)!r}: no {TUNE_DIR}/{SWEEP_FILE} with Ray Tune state there, so it is not a rayfed sweep."
    )


# Results ------------------------------------------------------------------------------------
def _finish(sweep: _Sweep, tune_dir: Path, grid: ray_tune.ResultGrid) -> SweepResult:
    """Write the trial table, then the plot and the best config, or raise if no trial completed."""
    records = _ordered([_record(sweep, result) for result in grid], sweep.spec.mode)
    _write_table(tune_dir, sweep, records)
    completed = [r for r in records if r.status == "completed"]
    if not completed:
        errors = [result.error for result in grid if result.error is not None]
        config_errors = [err for err in errors if isinstance(err, ConfigError)]
        if config_errors:
            raise ConfigError(str(getattr(config_errors[0], "cause", config_errors[0])))
        raise RuntimeError(
            f"no trial of the sweep completed ({len(errors)} errored, "
            f"{sum(r.status == 'stopped early' for r in records)} stopped early); see {tune_dir / TABLE_MD}"
            + (f"; first error: {getattr(errors[0], 'cause', errors[0])}" if errors else "")
        )
    best = completed[0]
    _write_plot(tune_dir / PLOT_FILE, sweep, records, best)
    best_config = tune_dir / BEST_FILE
    dump_config(sweep.trial_config(best.params), best_config)
    return SweepResult(tune_dir, sweep.spec.metric, sweep.spec.mode, records, best, best_config)


def _record(sweep: _Sweep, result: ray_tune.Result) -> TrialRecord:
    metrics = result.metrics or {}
    trial_id = Path(result.path).name
    if result.error is not None:
        status = "error"
    else:
        status = "completed" if metrics.get("final") else "stopped early"
    return TrialRecord(
        trial_id=trial_id, params=sweep.space.values(result.config), metric=metrics.get(sweep.spec.metric),
        rounds=int(metrics.get("round", 0)), status=status, run_dir=sweep.runs_dir / trial_id,
    )


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


def _write_plot(path: Path, sweep: _Sweep, records: list[TrialRecord], best: TrialRecord) -> None:
    """One panel per swept path: the metric of every trial (hollow: stopped early), the best starred."""
    paths = sweep.space.paths
    cols = min(len(paths), 3)
    rows = math.ceil(len(paths) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    measured = [r for r in records if r.metric is not None and not math.isnan(r.metric)]
    for ax, swept_path in zip(axes, paths, strict=False):  # spare panels of the last row stay empty
        values = [r.params[swept_path] for r in measured]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            position = dict(zip(map(id, measured), values, strict=True))
            if sweep.space.log_scale(swept_path):
                ax.set_xscale("log")
            elif all(isinstance(v, int) for v in values):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:  # vectors, strings, booleans: one tick per distinct value
            labels = list(dict.fromkeys(_cell(v) for v in values))
            position = {id(r): labels.index(_cell(v)) for r, v in zip(measured, values, strict=True)}
            ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
        for status, style in (("completed", {"color": "tab:blue"}),
                              ("stopped early", {"facecolors": "none", "edgecolors": "tab:gray"})):
            group = [r for r in measured if r.status == status]
            if group:
                ax.scatter([position[id(r)] for r in group], [r.metric for r in group], label=status, **style)
        ax.scatter([position[id(best)]], [best.metric], marker="*", s=180, color="tab:red", label="best")
        ax.set_xlabel(swept_path)
        ax.set_ylabel(sweep.spec.metric)
        ax.grid(alpha=0.3)
    for ax in axes[len(paths):]:
        ax.set_visible(False)
    axes[0].legend(fontsize="small")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    atomic_write_bytes(path, buffer.getvalue())
