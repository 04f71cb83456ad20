"""Weights & Biases: a W&B run per method (job type ``method``) and one for the config (job type ``run``: the
report's figures, report.md and summary.json), all in the run's group; a sweep's trials are runs of Ray Tune's
``WandbLoggerCallback`` in the sweep's group, beside a run of the sweep (job type ``sweep``: its trial table, plot and
best config). A resumed run continues the same W&B runs (their ids are kept in the run's ``tracking.json``).

Online, a W&B that cannot be reached (no network, no or bad API key) is said once, and every run is written offline
instead, to be uploaded later with the ``wandb sync`` command printed then.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import wandb
from ray.air.integrations.wandb import WandbLoggerCallback

from rayfed.config import WandbTracking
from rayfed.tracking.protocol import RUN, Site, first_line


class WandbRun:
    name: ClassVar[str] = "wandb"
    follows_sweeps: ClassVar[bool] = True

    def __init__(self, options: WandbTracking, site: Site):
        self.folder = Path(options.dir).expanduser() if options.dir else site.folder
        self.mode = options.mode
        self.project = options.project or os.environ.get("WANDB_PROJECT") or site.project
        self.group = site.group
        self.entity, self.tags = options.entity, list(options.tags)
        self.say, self.kind = site.say, site.kind
        self.runs: dict[str, Any] = {}

    def open(self, key: str, title: str, hyperparameters: dict[str, Any], kept: str | None) -> str:
        self.folder.mkdir(parents=True, exist_ok=True)
        arguments = dict(
            project=self.project, entity=self.entity, group=self.group, tags=self.tags, dir=str(self.folder),
            id=kept, name=title, config=hyperparameters, resume="allow", job_type=self.kind if key == RUN else "method",
            reinit="create_new",  # the config's run stays open beside each method's
        )
        try:
            run = wandb.init(mode=self.mode, **arguments)
        except Exception as err:  # noqa: BLE001 - whatever keeps W&B from starting online, its files are kept offline
            if self.mode == "offline":
                raise
            self.mode = "offline"
            self.say(f"[rayfed] tracking.wandb: W&B cannot be reached ({first_line(err)}), so its runs are written "
                     f"offline to {self.folder / 'wandb'}; upload them later with: "
                     f"wandb sync {self.folder / 'wandb'}/offline-run-*")
            run = wandb.init(mode="offline", **arguments)
        self.runs[key] = run
        return run.id

    def log(self, key: str, step: int, values: dict[str, float]) -> None:
        self.runs[key].log(values, step=step)

    def attach(self, key: str, files: list[Path]) -> None:
        run = self.runs[key]
        images = {f"report/{file.stem}": wandb.Image(str(file)) for file in files if file.suffix == ".png"}
        if images:
            run.log(images)
        for file in files:
            if file.suffix != ".png":
                run.save(str(file), base_path=str(file.parent), policy="now")

    def close(self, key: str, failed: bool) -> None:
        self.runs.pop(key).finish(exit_code=1 if failed else 0)
        if not self.runs:  # finish() can return before W&B's service has written a run's file: wait for it
            wandb.teardown()

    def tune_callback(self) -> Any:
        self.folder.mkdir(parents=True, exist_ok=True)
        return _TrialLogger(project=self.project, group=self.group, entity=self.entity, tags=self.tags,
                            mode=self.mode, dir=str(self.folder), job_type="trial")


class _TrialLogger(WandbLoggerCallback):
    """Ray Tune's W&B callback, which asks for an API key unless ``WANDB_MODE`` says offline, told so by its own
    ``mode`` too (offline W&B needs no key)."""

    def setup(self, *args: Any, **kwargs: Any) -> None:
        with mock.patch.dict(os.environ, {"WANDB_MODE": "offline"} if self.kwargs["mode"] == "offline" else {}):
            super().setup(*args, **kwargs)
