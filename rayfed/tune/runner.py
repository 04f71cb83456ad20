"""``rayfed tune`` and ``--resume``: run a sweep on Ray Tune and write its results."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
from ray import tune as ray_tune

from rayfed.config import RunConfig, dump_config, load_config
from rayfed.errors import ConfigError
from rayfed.simulation import RoundCallback, import_plugin_modules, init_ray
from rayfed.tune.plot import _write_plot
from rayfed.tune.sweep import EXPERIMENT_DIR, _Sweep
from rayfed.tune.tables import (BEST_FILE, PLOT_FILE, TABLE_CSV, TABLE_MD, SweepResult, _ordered, _record,
                                 _write_table)

TUNE_DIR = "tune"
SWEEP_FILE = "sweep.yaml"


def tune(
    config: RunConfig | dict | str | os.PathLike,
    *,
    overrides: list[str] | None = None,
    out_dir: str | os.PathLike | None = None,
    callbacks: list[RoundCallback] | None = None,
    verbose: int = 1,
    time_budget_s: float | None = None,
) -> SweepResult:
    """Run the sweep declared in ``config``'s ``tune:`` section; write results to ``<out_dir or runs/<name>>/tune``.

    ``callbacks`` run in every trial's Simulation (in the trial processes), each round before the
    report to Tune, so they also see the round at which a scheduler stops a trial.
    ``verbose`` is Ray Tune's (0 silent, 1 status, 2 with every result); past ``time_budget_s`` seconds of trials
    Tune stops the sweep (Ray Tune's ``TuneConfig.time_budget_s``).
    """
    run_config = load_config(config, overrides)
    import_plugin_modules(run_config)
    run_config.tracking.check_installed()
    tune_dir = _fresh_tune_dir(run_config.name, out_dir)
    sweep = _Sweep.build(run_config, tune_dir, callbacks)
    with _ray(run_config):
        sweep.check_cluster()
        tune_dir.mkdir(parents=True, exist_ok=True)
        sweep.gpu_memory.save()
        dump_config(run_config, tune_dir / SWEEP_FILE)
        with _tracked(run_config, tune_dir) as tracking:
            tuner = ray_tune.Tuner(
                sweep.trainable(), param_space=sweep.space.param_space(), tune_config=sweep.tune_config(time_budget_s),
                run_config=sweep.run_config(tune_dir, verbose, tracking.callbacks() if tracking else []),
            )
            return _finish(sweep, tune_dir, _fit(tuner))


def resume(run_dir: str | os.PathLike, *, callbacks: list[RoundCallback] | None = None) -> SweepResult:
    """Continue the sweep in ``run_dir`` (or ``run_dir/tune``): unfinished and errored trials go on from checkpoints.

    Tune keeps the sweep's own settings (e.g. its verbosity); ``callbacks`` as for :func:`tune`.
    """
    tune_dir = _existing_tune_dir(run_dir)
    run_config = load_config(tune_dir / SWEEP_FILE)
    import_plugin_modules(run_config)
    run_config.tracking.check_installed()
    sweep = _Sweep.build(run_config, tune_dir, callbacks)
    with _ray(run_config):
        sweep.check_cluster()
        with _tracked(run_config, tune_dir):  # Tune restores its logger callbacks with the rest of the sweep
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


@contextlib.contextmanager
def _tracked(config: RunConfig, tune_dir: Path) -> Iterator[Any]:
    """The sweep's trackers (None without any), its own tracked runs given its results at the end."""
    if not config.tracking.trackers:
        yield None
        return
    from rayfed.tracking import SweepTracking

    tracking = SweepTracking(config, tune_dir)
    try:
        yield tracking
    except BaseException:
        tracking.close(failed=True)
        raise
    tracking.finish([path for path in (tune_dir / name for name in (TABLE_CSV, TABLE_MD, PLOT_FILE, BEST_FILE))
                     if path.is_file()])


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
