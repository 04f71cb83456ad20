"""MLflow: a parent run for the config (the report's figures, report.md and summary.json as its artifacts) holding
a nested run per method, in the experiment named after the config; a sweep's trials are runs of Ray Tune's
``MLflowLoggerCallback`` nested in a parent run of the sweep (its trial table, plot and best config). A resumed run
continues the same MLflow runs (their ids are kept in the run's ``tracking.json``).

Written through ``MlflowClient`` with explicit run ids, so nothing depends on MLflow's active run. A ``file:`` store
(or a plain folder) is opted into as MLflow 3 asks (``MLFLOW_ALLOW_FILE_STORE``), since the config asked for it.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import MAX_METRICS_PER_BATCH, MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

from rayfed.config import MlflowTracking
from rayfed.tracking.protocol import RUN, Site

PARENT_TAG = "mlflow.parentRunId"  # how MLflow nests a run under another


class MlflowRun:
    name: ClassVar[str] = "mlflow"
    follows_sweeps: ClassVar[bool] = True

    def __init__(self, options: MlflowTracking, site: Site):
        self.tracking_uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if self.tracking_uri is not None and urlparse(self.tracking_uri).scheme in ("", "file"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_name = options.experiment or site.project
        self.tags = {**options.tags, "rayfed.group": site.group}
        self.ids: dict[str, str] = {}

    def open(self, key: str, title: str, hyperparameters: dict[str, Any], kept: str | None) -> str:
        if kept is not None:
            self.client.update_run(kept, status=RunStatus.to_string(RunStatus.RUNNING))
            self.ids[key] = kept
            return kept
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(self.experiment_name)
        tags = self.tags if key == RUN else {**self.tags, PARENT_TAG: self.ids[RUN]}
        run_id = self.ids[key] = self.client.create_run(experiment_id, run_name=title, tags=tags).info.run_id
        params = [Param(_key(name), str(value)[:MAX_PARAM_VAL_LENGTH]) for name, value in hyperparameters.items()]
        for start in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            self.client.log_batch(run_id, params=params[start:start + MAX_PARAMS_TAGS_PER_BATCH])
        return run_id

    def log(self, key: str, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [Metric(_key(name), float(value), now, step) for name, value in values.items()]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.ids[key], metrics=metrics[start:start + MAX_METRICS_PER_BATCH])

    def attach(self, key: str, files: list[Path]) -> None:
        for file in files:  # the figures in a folder of their own
            folder = "report" if file.suffix == ".png" else None
            self.client.log_artifact(self.ids[key], str(file), artifact_path=folder)

    def close(self, key: str, failed: bool) -> None:
        self.client.set_terminated(self.ids.pop(key), status="FAILED" if failed else "FINISHED")

    def tune_callback(self) -> Any:
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        return MLflowLoggerCallback(tracking_uri=self.tracking_uri, experiment_name=self.experiment_name,
                                    tags={**self.tags, PARENT_TAG: self.ids[RUN]})


def _key(name: str) -> str:
    """A metric or parameter name as MLflow takes it: characters it refuses (a view's ``@``) become ``_``."""
    return re.sub(r"[^/\w.\- :]", "_", name)
