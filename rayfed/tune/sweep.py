"""A sweep checked before any trial starts (config, space, metric, resources), Ray Tune's objects for it, and
the trial function."""

from __future__ import annotations

import copy
import functools
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import yaml
from ray import tune as ray_tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from rayfed import registry
from rayfed.config import RunConfig, TrackingConfig, apply_overrides, build_config, with_full_params
from rayfed.errors import ConfigError, suggest
from rayfed.method import build_method
from rayfed.config.sections import MEASURED
from rayfed.simulation import RoundCallback, Simulation, ship_by_value
from rayfed.simulation.gpu_memory import CACHE_FILE, GpuMemory, Measurement, measures_memory
from rayfed.simulation.placement import refuse_split_gpu_shares
from rayfed.tune.metric import _check_metric_name, _metric_of, _Reporter
from rayfed.tune.resources import trial_resources
from rayfed.tune.space import SearchSpace
from rayfed.tune.spec import TuneSpec, _parse_spec

EXPERIMENT_DIR = "experiment"
RUNS_DIR = "runs"


@dataclass(frozen=True)
class _Sweep:
    """Everything a trial needs, shipped to the trial processes."""

    base: dict[str, Any]
    spec: TuneSpec
    space: SearchSpace
    runs_dir: Path
    callbacks: tuple[RoundCallback, ...]
    max_rounds: int
    gpu_memory: GpuMemory  # gpus_per_actor: measured, measured once per configuration of a different memory
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
        asha = spec.scheduler
        last_rung = asha.max_t or max_rounds
        if asha.name == "asha" and asha.grace_period is not None and asha.grace_period > last_rung:
            raise ConfigError(
                f"tune.scheduler.grace_period = {asha.grace_period} is more than the {last_rung} rounds "
                "a trial runs; it must be at most that."
            )
        plugins = tuple(registry.user_entries())
        ship_by_value(entry.obj for entry in plugins)
        return cls(base, spec, space, tune_dir / RUNS_DIR, tuple(callbacks or ()), max_rounds,
                   GpuMemory(tune_dir / CACHE_FILE), plugins)

    def check_cluster(self) -> None:
        """Measure the GPU shares of ``gpus_per_actor: measured`` for every combination of the swept values (once per
        configuration of a different memory; a trial's share is then looked up as Tune places it, never measured
        while trials hold the GPUs); then a trial larger than the whole cluster would wait forever: say so instead."""
        configs = _checked_configs(self.base, self.space)
        if any(measures_memory(config) for config in configs):
            configs += _combinations(self.base, self.space)
        groups = [trial_resources(config, self.gpu_memory) for config in configs]
        self.gpu_memory.probe = _not_measured_before
        available = ray.cluster_resources()
        for resource in ("CPU", "GPU"):
            needed = max(group.required_resources.get(resource, 0.0) for group in groups)
            if needed > available.get(resource, 0.0) + 1e-9:
                raise ConfigError(
                    f"placement: one trial's placement group needs {needed:g} {resource} (the DriverActor's bundle "
                    f"plus one per ClientActor) but the Ray cluster has {available.get(resource, 0.0):g}; raise "
                    f"placement.clients_per_actor or lower placement.{resource.lower()}s_per_actor."
                )
        for group in groups:
            refuse_split_gpu_shares([bundle.get("GPU", 0.0) for bundle in group.bundles], available.get("GPU", 0.0),
                                    "ClientActors of one trial")

    def trial_config(self, values: dict[str, Any]) -> RunConfig:
        """The run config of one trial, given config path -> value."""
        return _trial_config(self.base, values)

    # Ray Tune objects ----------------------------------------------------------------------
    def trainable(self) -> Any:
        trainable = ray_tune.with_parameters(_run_trial, sweep=self)
        return ray_tune.with_resources(trainable, resources=functools.partial(_trial_resources_for, self))

    def tune_config(self, time_budget_s: float | None = None) -> ray_tune.TuneConfig:
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
            num_samples=spec.num_samples, max_concurrent_trials=max_concurrent, time_budget_s=time_budget_s,
            trial_dirname_creator=_trial_dirname,
            # A finished trial's process (torch already imported) runs the next trial; a stopped trial's
            # Simulation unwinds first (Tune ends it inside tune.report), killing its actors.
            reuse_actors=True,
        )

    def run_config(self, tune_dir: Path, verbose: int, callbacks: list[Any]) -> ray_tune.RunConfig:
        """``callbacks``: Ray Tune's logger callbacks of the sweep's trackers (:mod:`rayfed.tracking`)."""
        return ray_tune.RunConfig(
            name=EXPERIMENT_DIR, storage_path=str(tune_dir), verbose=verbose, callbacks=callbacks,
            failure_config=ray_tune.FailureConfig(max_failures=self.spec.max_failures),
        )


def _trial_config(base: dict[str, Any], values: dict[str, Any]) -> RunConfig:
    raw = copy.deepcopy(base)
    raw["tune"] = None
    # safe_dump writes values in the form apply_overrides' YAML parsing reads back unchanged (e.g. 1.0e-07).
    overrides = [f"{path}={yaml.safe_dump(value, default_flow_style=True)}" for path, value in values.items()]
    config = build_config(apply_overrides(raw, overrides))
    # Every hyperparameter of each method as the trial builds it, defaults included: best.yaml records them all.
    return with_full_params(config, [build_method(entry, index).params for index, entry in enumerate(config.methods)])


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


MEASURED_COMBINATIONS = 256
"""At most this many combinations of the swept values are measured before a sweep (gpus_per_actor: measured);
beyond it, each swept path's values with the others at their first."""


def _combinations(base: dict[str, Any], space: SearchSpace) -> list[RunConfig]:
    """The config of every combination of the swept paths' representative values (none past
    :data:`MEASURED_COMBINATIONS`)."""
    values = [list(swept.variations()) for swept in space.swept]
    if math.prod(len(options) for options in values) > MEASURED_COMBINATIONS:
        return []
    paths = [swept.path for swept in space.swept]
    return [_trial_config(base, dict(zip(paths, combination))) for combination in itertools.product(*values)]


def _not_measured_before(config: RunConfig, name: str, slot: tuple[int, ...]) -> Measurement:
    raise ConfigError(
        f"placement.gpus_per_actor: {MEASURED}: a trial's {'architecture ' + repr(name) if name else 'model'} differs "
        "from every configuration measured before the sweep started (the combinations of the grid and choice values "
        "and of the ranges' bounds and middles); sweep what changes the model with grid or choice, or set "
        "gpus_per_actor to a number."
    )


def _format_values(values: dict[str, Any]) -> str:
    return ", ".join(f"{path} = {value!r}" for path, value in values.items())


def _trial_dirname(trial: Any) -> str:
    return trial.trial_id


def _trial_resources_for(sweep: _Sweep, params: dict[str, Any]) -> ray_tune.PlacementGroupFactory:
    return trial_resources(sweep.trial_config(sweep.space.values(params)), sweep.gpu_memory)


def _run_trial(params: dict[str, Any], sweep: _Sweep) -> None:
    registry.install(sweep.plugins)
    run_dir = sweep.runs_dir / ray_tune.get_context().get_trial_id()
    callbacks = [*sweep.callbacks, _Reporter(sweep.spec)]  # the reporter last: a stopped trial ends inside it
    if (run_dir / "config.yaml").is_file():  # Tune restarted this trial: continue from its engine checkpoints
        sim = Simulation.resume(run_dir, callbacks=callbacks, progress=False)
    else:  # the sweep's trackers follow the trial through Tune's callbacks, not a tracked run of its own
        config = sweep.trial_config(sweep.space.values(params)).model_copy(update={"tracking": TrackingConfig()})
        sim = Simulation(config, out_dir=run_dir, callbacks=callbacks, progress=False)
    summary = sim.run()
    means = summary["methods"][sweep.spec.label]["mean"]
    ray_tune.report({sweep.spec.metric: _metric_of(sweep.spec, means),
                     "round": sim.config.federation.rounds, "final": True})
