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

Any field a method's ``Params`` dataclass declares is ``methods.<index>.<name>``, so a method's sweep is one
YAML (``configs/tune/`` holds full sweeps). FedProx's proximal strength, with the learning rate::

    methods: [{name: fedprox, mu: 0.01}]
    tune:
      metric: fedprox/local_acc
      search: grid
      space:
        methods.0.mu: {grid: [0.001, 0.01, 0.1]}
        train.lr: {grid: [1.0e-3, 3.0e-3]}
        seed: {grid: [0, 1, 2]}

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
trial's full config, every method hyperparameter included, ready for ``rayfed run``),
``metric_vs_params.png``, ``sweep.yaml`` (the sweep itself, read by ``--resume``), ``runs/`` (one run directory per
trial) and ``experiment/`` (Ray Tune's state). With a ``tracking:`` section, every trial is a tracked run of Ray
Tune's own W&B, MLflow and TensorBoard integrations, grouped by the sweep, beside the sweep's own tracked run
(:mod:`rayfed.tracking`).

One job a module: ``spec`` (the ``tune:`` section), ``space`` (search spaces), ``sweep`` (the checked sweep,
Tune's objects and the trial function), ``metric`` (what a trial reports), ``resources`` (a trial's placement
group), ``runner`` (:func:`tune`, :func:`resume`), ``tables`` and ``plot`` (the results).
"""

from __future__ import annotations

from rayfed.tune.resources import trial_resources
from rayfed.tune.runner import resume, tune
from rayfed.tune.space import SearchSpace
from rayfed.tune.spec import SchedulerSpec, TuneSpec
from rayfed.tune.tables import SweepResult, TrialRecord

__all__ = [
    "SchedulerSpec", "SearchSpace", "SweepResult", "TrialRecord", "TuneSpec", "resume", "trial_resources", "tune",
]
