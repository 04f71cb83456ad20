"""What keeps code written against older rayfed working, each with one sentence saying what to write instead."""

from __future__ import annotations

import warnings

from rayfed.stages import AfterFederationStage, PreFederationStage, PublicPassStage, Stage

LEGACY_STAGE_FLAGS = ("pre_federation_stage", "public_passes")
"""``Method`` flags that ``Method.stages`` replaced: ``pre_federation_stage = True`` is ``PreFederationStage()``,
``public_passes = n`` is ``PublicPassStage(n)``."""


def legacy_stages(cls: type, base: type) -> tuple[Stage, ...] | None:
    """The stages a method class written before ``Method.stages`` meant, or None for one that needs no translation.

    Its own ``pre_federation_stage`` / ``public_passes`` flags become the stages they declared; and a class that
    overrides ``after_federation`` while no class from ``base`` down declares ``stages`` (the hook always ran
    then) gets :class:`AfterFederationStage`. A FutureWarning says what to declare instead."""
    own = vars(cls)
    flags = [flag for flag in LEGACY_STAGE_FLAGS if flag in own]
    declares = any("stages" in vars(klass) for klass in cls.__mro__ if klass is not base and issubclass(klass, base))
    if flags and "stages" in own:
        raise TypeError(f"{cls.__name__} sets both stages and {', '.join(flags)}; declare its stages in stages only.")
    legacy_after = (not declares and cls.after_federation is not base.after_federation
                    and not any(isinstance(stage, AfterFederationStage) for stage in cls.stages))
    if not flags and not legacy_after:
        return None
    stages = [stage for stage in cls.stages if not (
        ("pre_federation_stage" in flags and isinstance(stage, PreFederationStage))
        or ("public_passes" in flags and isinstance(stage, PublicPassStage)))]
    if own.get("pre_federation_stage"):
        stages.append(PreFederationStage())
    if own.get("public_passes"):
        stages.append(PublicPassStage(own["public_passes"]))
    if legacy_after:
        stages.append(AfterFederationStage())
    declaration = ", ".join(f"rayfed.{type(stage).__name__}({getattr(stage, 'count', '')})" for stage in stages)
    was = ", ".join([*(f"{flag} = {own[flag]!r}" for flag in flags),
                     *(["an after_federation"] if legacy_after else [])])
    declared = f"({declaration}{',' if len(stages) == 1 else ''})"
    warnings.warn(f"{cls.__name__}: {was} is deprecated; declare stages = {declared} instead.", FutureWarning,
                  stacklevel=3)
    return tuple(stages)
