"""A run: set up fresh or resumed from its folder, then every method in turn (:class:`MethodRun`: round after round,
with evaluations, checkpoints and its results written), started again after an actor died, and the run's summary and
report written. Runs in the user's process (driver script or CLI).

Only ObjectRefs of payloads and uploads pass through this process; client data is loaded by the actors that host the
clients.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from tqdm.auto import tqdm

from rayfed.architectures import actor_slots
from rayfed.compute import matched_steps
from rayfed.config import RunConfig, dump_config, load_config, model_configs, with_full_params
from rayfed.data.clients import build_federation
from rayfed.errors import ConfigError
from rayfed.executors import LocalExecutor, RayExecutor
from rayfed.io import atomic_write_json
from rayfed.run_methods import run_methods
from rayfed.simulation.actors import RunActors
from rayfed.simulation.nonfinite import NonfiniteCheck
from rayfed.simulation.gpu_memory import fitted_slots_measured
from rayfed.simulation.method_run import MethodRun
from rayfed.simulation.placement import planned_costs
from rayfed.simulation.preflight import check_model
from rayfed.simulation.ray_setup import (ObjectStoreCheck, import_plugin_modules, init_ray, is_actor_failure,
                                        unwrap_actor_error)
from rayfed.simulation.results import MetricsLog, run_summary
from rayfed.simulation.rounds import measured_costs

RoundCallback = Callable[["Simulation", str, int], None]
"""Called as ``callback(simulation, method_label, rounds_done)`` after every round."""


class Simulation:
    """One run: every configured method on the same clients, partitions and seed.

    >>> summary = rayfed.Simulation("configs/quickstart.yaml").run()
    """

    def __init__(
        self,
        config: RunConfig | dict | str | os.PathLike,
        *,
        overrides: list[str] | None = None,
        out_dir: str | os.PathLike | None = None,
        callbacks: list[RoundCallback] | None = None,
        progress: bool = True,
        check_model: bool = True,
    ):
        """``check_model=False`` skips building and running every method's model in this process before the
        actors start (:func:`rayfed.simulation.preflight.check_model`), for a caller that has just done so
        (``rayfed bench``)."""
        self._set_up(load_config(config, overrides), lambda name: _fresh_run_dir(name, out_dir), False,
                     callbacks, progress, check_model)

    @classmethod
    def resume(cls, run_dir: str | os.PathLike, *, callbacks: list[RoundCallback] | None = None, progress: bool = True,
               check_model: bool = True) -> Simulation:
        """Continue the run in ``run_dir`` from its checkpoints; ends with the uninterrupted run's numbers."""
        run_dir = Path(run_dir)
        config_path = run_dir / "config.yaml"
        if not config_path.is_file():
            raise ConfigError(f"--resume {str(run_dir)!r}: no config.yaml there, so it is not a rayfed run directory.")
        sim = cls.__new__(cls)
        sim._set_up(load_config(config_path), lambda name: run_dir, True, callbacks, progress, check_model)
        return sim

    def _set_up(self, config: RunConfig, run_dir: Callable[[str], Path], resuming: bool,
                callbacks: list[RoundCallback] | None, progress: bool, check_model: bool) -> None:
        """What a fresh and a resumed run share; ``run_dir`` gives the run's folder from the config's name once the
        config's plug-in modules are imported."""
        self.config = config
        import_plugin_modules(config)
        config.tracking.check_installed()
        self.callbacks = list(callbacks or [])
        self.progress = progress
        self.check_model = check_model
        self.run_dir = run_dir(config.name)
        self._results_dir, self._checkpoint_dir = self.run_dir / "results", self.run_dir / "checkpoints"
        self._resuming = resuming
        self.run_actors: RunActors | None = None
        self.gpu_memory: dict[str, dict] = {}  # the measured GPU shares (gpus_per_actor: measured), for summary.json
        self.object_store_check = ObjectStoreCheck()

    # Public API ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Run every method, write the results contract into ``run_dir``, return the summary."""
        started = time.perf_counter()
        self._build_run()
        if self.check_model:
            check_model(self.config, self.federation, self.methods)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(self.config, self.run_dir / "config.yaml")
        with _followed_log(self.config, self.run_dir, self._resuming) as self.log:
            self.nonfinite = NonfiniteCheck(self.config.federation.on_nonfinite)
            owns_ray = self._start_executor()
            try:
                self.compute_match = self._match_compute()
                for index, entry in enumerate(self.config.methods):
                    if self._resuming and (self._results_dir / f"{entry.label}.json").is_file():
                        continue
                    self._run_method(index)
            finally:
                self.run_actors.stop()
                if owns_ray:
                    ray.shutdown()
            summary = run_summary(self.config, self._results_dir, self.log.events, time.perf_counter() - started,
                                  self.compute_match, self.gpu_memory)
            atomic_write_json(self.run_dir / "summary.json", summary)
            from rayfed.results.report import write_report

            write_report(self.run_dir, summary, self.log.events)
        return summary

    def compute_costs(self) -> dict[str, dict[str, float]]:
        """``train.compute_match``'s measurement alone (nothing is trained past it, nothing written): per method
        label its local update's ``flops``, ``cost_ratio`` to the reference and ``local_steps``."""
        if self.config.train.compute_match is None:
            raise ConfigError("train.compute_match is not set, so there is no reference to measure costs against; "
                              "set train.compute_match.reference to a method label.")
        self._build_run()
        owns_ray = self._start_executor()
        try:
            return self._match_compute()
        finally:
            if owns_ray:
                ray.shutdown()

    def data_summary(self, png: str | os.PathLike | None = None) -> dict[str, Any]:
        """Each client's train / test sample counts and histogram over labels (or tasks), from the data config
        alone (no Ray, no model); with ``png``, also a stacked bar per client saved there."""
        from rayfed.data.summary import data_summary, plot_summary

        summary = data_summary(build_federation(self.config.data, self.config.seed, model_configs(self.config)))
        if png is not None:
            plot_summary(summary, png)
        return summary

    @property
    def actors(self) -> list[Any]:
        """The ClientActors' handles, in slot order (none while no method runs)."""
        return self.run_actors.clients if self.run_actors else []

    @property
    def driver(self) -> Any:
        """The DriverActor's handle (None while no method runs)."""
        return self.run_actors.driver if self.run_actors else None

    # Setup ------------------------------------------------------------------------------
    def _build_run(self) -> None:
        """The clients' data and the methods, built once here; the config records every hyperparameter."""
        self.federation = build_federation(self.config.data, self.config.seed, model_configs(self.config))
        self.num_train = {cid: self.federation.sizes(cid)["num_train"] for cid in range(self.federation.num_clients)}
        self.methods = run_methods(self.config, self.federation)
        self.config = with_full_params(self.config, [method.params for method in self.methods])

    def _start_executor(self) -> bool:
        """The executor and the actors' slots (fitted to the Ray cluster, with the measured GPU shares); whether this
        run started Ray."""
        local = self.config.placement.executor == "local"
        costs = planned_costs(self.config, self.num_train)
        self.executor = LocalExecutor() if local else RayExecutor()
        owns_ray = not local and init_ray(self.config)
        try:
            if local:
                slots = actor_slots(self.config, costs=costs)
            else:
                slots, self.gpu_memory = fitted_slots_measured(self.config, costs, self.run_dir)
        except Exception:
            if owns_ray:
                ray.shutdown()
            raise
        self.run_actors = RunActors(self.config, self.methods, self.federation, self.executor, slots)
        return owns_ray

    def _match_compute(self) -> dict[str, dict[str, float]]:
        """``train.compute_match``: per method label its costs, cost ratio to the reference and local steps
        (:mod:`rayfed.compute`, :func:`measured_costs`); ``{}`` without the option."""
        match = self.config.train.compute_match
        if match is None:
            return {}
        local, server = measured_costs(self.run_actors, match.client, self.num_train)
        return matched_steps(local, match.reference, self.config.train.local_steps, server)

    # Each method ------------------------------------------------------------------------
    def _run_method(self, method_index: int) -> None:
        """The method from its last checkpoint (or its start) to its results; started again from the last checkpoint
        after an actor or node died, up to ``federation.max_failures`` times."""
        entry = self.config.methods[method_index]
        local_steps = self.compute_match[entry.label]["local_steps"] if self.compute_match else None
        failures = 0
        while True:
            try:
                self.run_actors.start_method(method_index, local_steps)
                self.federation = self.run_actors.federation  # on Ray: views of the object store's copy
                MethodRun(self.config, method_index, self.methods[method_index], self.run_actors, self.federation,
                          self.num_train, self.log, self.nonfinite, self.object_store_check, self._results_dir,
                          self._checkpoint_dir, self._after_round, self.progress).run()
                return
            except Exception as err:  # noqa: BLE001 - only actor/node deaths are retried
                if not is_actor_failure(err):
                    raise unwrap_actor_error(err) from None
                failures += 1
                self.run_actors.stop()
                if failures > self.config.federation.max_failures:
                    raise RuntimeError(
                        f"method {entry.label!r}: {failures} actor failures, more than "
                        f"federation.max_failures = {self.config.federation.max_failures}; last: {err}"
                    ) from err
                tqdm.write(f"[rayfed] {entry.label}: an actor died ({type(err).__name__}); "
                           "restoring from the last checkpoint")

    def _after_round(self, label: str, rounds_done: int) -> None:
        """Every callback, after a round of the method ``label``."""
        for callback in self.callbacks:
            callback(self, label, rounds_done)


@contextlib.contextmanager
def _followed_log(config: RunConfig, run_dir: Path, resuming: bool) -> Iterator[MetricsLog]:
    """The run's metrics.jsonl (a resumed run's: with its events so far), which hands every event to the trackers
    the config's ``tracking:`` asks for (:mod:`rayfed.tracking`; none: nothing of it is imported); when the run is
    done they get its report, and when it stops on an error their tracked runs are closed as failed."""
    previous = MetricsLog.read(run_dir / "metrics.jsonl") if resuming else []
    if not config.tracking.trackers:
        yield MetricsLog(run_dir / "metrics.jsonl", previous)
        return
    from rayfed.results.report import CLIENTS_NAME, CURVES_NAME, REPORT_NAME, TRADEOFF_NAME
    from rayfed.tracking import RunTracking

    tracking = RunTracking(config, run_dir)
    tracking.replay(previous)
    try:
        yield MetricsLog(run_dir / "metrics.jsonl", previous, listener=tracking)
    except BaseException:
        tracking.close(failed=True)
        raise
    report = [run_dir / name for name in ("summary.json", CURVES_NAME, CLIENTS_NAME, TRADEOFF_NAME, REPORT_NAME)]
    tracking.finish([file for file in report if file.is_file()])


def _fresh_run_dir(name: str, out_dir: str | os.PathLike | None) -> Path:
    if out_dir is not None:
        path = Path(out_dir)
        if (path / "config.yaml").exists():
            raise ConfigError(
                f"--out {str(path)!r} already holds a run; pass --resume {str(path)!r} to continue it, "
                "or choose another --out (nothing there is overwritten)."
            )
        return path
    base = Path("runs") / name
    path, suffix = base, 1
    while path.exists() and any(path.iterdir()):
        suffix += 1
        path = base.with_name(f"{base.name}-{suffix}")
    return path
