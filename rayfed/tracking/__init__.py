"""Runs and sweeps followed in the experiment trackers researchers already watch: TensorBoard, Weights & Biases and
MLflow, as the config's ``tracking:`` section asks (each off unless asked for; with none, nothing here runs and no
tracker's package is imported).

What each tracker gets, one tracked run per method grouped under the config's own run:

- the config, flattened (``train.lr``, ``data.partition.alpha``, ...), as hyperparameters, each method's run with
  its method's entry and every hyperparameter of it (``method.params.lam``);
- every event of ``metrics.jsonl`` at its round: a round's figures (``round/wall_s``, ``round/up_bytes``,
  ``round/down_bytes``, ``round/train_loss``, and whatever else the round event counts, such as GPU memory or
  TFLOP/s), an evaluation's mean and spread over clients (``eval/local_acc``, ``eval_std/local_acc``; with
  ``tracking.per_client``, ``client/<id>/local_acc`` too);
- at the end of the run, on the config's own run: the report's figures, report.md and summary.json.

A sweep's trials are Ray Tune's own integrations (``WandbLoggerCallback``, ``MLflowLoggerCallback``,
``TBXLoggerCallback``): each trial a tracked run in the sweep's group, its sampled values as its hyperparameters.

One job a module: ``protocol`` (what a tracker does), ``following`` (the trackers of a run or a sweep, resumed from
the folder's ``tracking.json``), and one module per tracker: ``tensorboard_run``, ``wandb_run``, ``mlflow_run``.
"""

from __future__ import annotations

from rayfed.tracking.following import RECORD_FILE, RunTracking, SweepTracking, event_values
from rayfed.tracking.protocol import RUN, Site, Tracker, flat

__all__ = ["RECORD_FILE", "RUN", "RunTracking", "Site", "SweepTracking", "Tracker", "event_values", "flat"]
