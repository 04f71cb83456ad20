"""The ``tracking:`` section: which experiment trackers follow a run or a sweep (TensorBoard, Weights & Biases,
MLflow), each off unless asked for, and their options. What they receive is :mod:`rayfed.tracking`'s."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, model_validator

from rayfed.config.fields import Section
from rayfed.errors import ConfigError

TRACKERS = ("tensorboard", "wandb", "mlflow")
PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}
"""The package each tracker writes with; ``pip install 'rayfed[<tracker>]'`` installs it."""


class _Tracker(Section):
    """A tracker's options; ``true`` turns it on with every option at its default."""

    @model_validator(mode="before")
    @classmethod
    def _on_with_defaults(cls, raw: Any) -> Any:
        return {} if raw is True else raw


class TensorBoardTracking(_Tracker):
    log_dir: str | None = Field(
        None, description="the folder TensorBoard reads (tensorboard --logdir); a run writes <log_dir>/<run folder>/"
        "<method label>/; default: the run's folder's tensorboard/ (a sweep's trials: Ray Tune's own event files in "
        "tune/experiment/<trial>/)"
    )


class WandbTracking(_Tracker):
    project: str | None = Field(None, description="default: $WANDB_PROJECT, else the config's name")
    entity: str | None = Field(None, description="the W&B team or user; default: W&B's default entity")
    group: str | None = Field(None, description="the runs' group; default: the run's (or sweep's) folder name")
    tags: tuple[str, ...] = ()
    mode: Literal["online", "offline"] = Field(
        "online", description="offline: W&B's files only, uploaded later with `wandb sync`; an online run that cannot "
        "reach W&B falls back to offline and says so once"
    )
    dir: str | None = Field(None, description="where W&B writes its files (a wandb/ folder); default: the run's folder")


class MlflowTracking(_Tracker):
    tracking_uri: str | None = Field(
        None, description="http(s)://host:port of a tracking server, a database URI, or a file: store; default: "
        "$MLFLOW_TRACKING_URI, else MLflow's own default"
    )
    experiment: str | None = Field(None, description="default: the config's name")
    group: str | None = Field(
        None, description="the name of the parent run holding the methods' (or trials') runs; default: the run's (or "
        "sweep's) folder name"
    )
    tags: dict[str, str] = {}


class TrackingConfig(Section):
    """Experiment trackers of a run or a sweep; unset (the default) none is imported and nothing changes."""

    tensorboard: TensorBoardTracking | None = None
    wandb: WandbTracking | None = None
    mlflow: MlflowTracking | None = None
    per_client: bool = Field(False, description="also log every client's value of every evaluated metric")

    @model_validator(mode="before")
    @classmethod
    def _off(cls, raw: Any) -> Any:
        if raw is None:
            return {}
        if isinstance(raw, dict):  # `tracking.mlflow=false`: off
            return {key: None if value is False and key in TRACKERS else value for key, value in raw.items()}
        return raw

    @property
    def trackers(self) -> list[str]:
        """The names of the trackers asked for, in a fixed order."""
        return [name for name in TRACKERS if getattr(self, name) is not None]

    def check_installed(self) -> None:
        """Refuse, in one sentence, a tracker asked for whose package is not installed (found, not imported)."""
        for name in self.trackers:
            if importlib.util.find_spec(PACKAGES[name]) is None:
                raise ConfigError(f"tracking.{name} needs the {PACKAGES[name]} package, which is not installed; "
                                  f"pip install 'rayfed[{name}]', or leave tracking.{name} unset.")
