"""A method's stages besides its rounds, as values it declares (``Method.stages``) and the engine runs.

- :class:`PreFederationStage`: before round 1, ``Method.pre_federation`` once per architecture on one of its actors
  (its model, ``data.public``, the round-0 parameters), then ``Method.before_federation`` on the DriverActor with
  what each architecture returned (e.g. aligning adapters across architectures).
- :class:`PublicPassStage`: after each round's aggregation, ``count`` passes on public data: pass p asks
  ``Method.public_request`` for each architecture's request, runs ``Method.public_pass`` on one actor of that
  architecture, and hands what every architecture returned to ``Method.after_public_pass`` (e.g. distillation).
- :class:`AfterFederationStage`: after the last round, ``Method.after_federation`` on every client.

A stage runs only when declared, never inferred; a method class that overrides a stage's hooks without declaring
the stage is refused when the class is defined (:func:`check_stages`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar


@dataclass(frozen=True)
class PreFederationStage:
    """Before round 1: ``pre_federation`` per architecture, then ``before_federation`` on the server."""

    hooks: ClassVar[tuple[str, ...]] = ("pre_federation", "before_federation")


@dataclass(frozen=True)
class PublicPassStage:
    """After each aggregation: ``count`` server-side passes on public data."""

    count: int
    hooks: ClassVar[tuple[str, ...]] = ("public_request", "public_pass", "after_public_pass")

    def __post_init__(self) -> None:
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"PublicPassStage.count = {self.count!r} must be an integer >= 1.")


@dataclass(frozen=True)
class AfterFederationStage:
    """After the last round: ``after_federation`` on every client."""

    hooks: ClassVar[tuple[str, ...]] = ("after_federation",)


Stage = PreFederationStage | PublicPassStage | AfterFederationStage
STAGE_KINDS = (PreFederationStage, PublicPassStage, AfterFederationStage)
S = TypeVar("S", PreFederationStage, PublicPassStage, AfterFederationStage)


def declared(method: object, kind: type[S]) -> S | None:
    """The stage of ``kind`` that ``method`` (a method object or class) declares, or None."""
    return next((stage for stage in getattr(method, "stages", ()) if type(stage) is kind), None)


def public_pass_count(method: object) -> int:
    """How many public passes follow each of ``method``'s aggregations (0 without a :class:`PublicPassStage`)."""
    stage = declared(method, PublicPassStage)
    return stage.count if stage is not None else 0


def check_stages(cls: type, stages: Sequence[object], base: type) -> None:
    """One sentence (TypeError) for a ``stages`` entry that is not a stage value, a kind declared twice, or a hook of
    ``cls`` overriding ``base``'s whose stage ``stages`` lacks (the hook would never run)."""
    for stage in stages:
        if not isinstance(stage, STAGE_KINDS):
            raise TypeError(f"{cls.__name__}.stages holds {stage!r}; its entries are rayfed.PreFederationStage(), "
                            "rayfed.PublicPassStage(count) or rayfed.AfterFederationStage().")
    kinds = [type(stage) for stage in stages]
    twice = next((kind for kind in kinds if kinds.count(kind) > 1), None)
    if twice is not None:
        raise TypeError(f"{cls.__name__}.stages declares {twice.__name__} twice; declare each stage once.")
    for kind in STAGE_KINDS:
        overridden = [hook for hook in kind.hooks if getattr(cls, hook, None) is not getattr(base, hook)]
        if overridden and kind not in kinds:
            declaration = f"{kind.__name__}(count)" if kind is PublicPassStage else f"{kind.__name__}()"
            raise TypeError(f"{cls.__name__} overrides {', '.join(overridden)} but its stages do not declare "
                            f"{kind.__name__}, so the engine would never run it: add rayfed.{declaration} to "
                            f"{cls.__name__}.stages.")
