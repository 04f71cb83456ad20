"""The ``tune:`` section of a run config, validated; errors name ``tune.<field>``."""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayfed.errors import ConfigError, suggest


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
