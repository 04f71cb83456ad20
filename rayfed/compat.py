"""What older code, configs and checkpoints wrote, and what to do with it now: every migration in one place, one
section per kind. Each old form is either still read (a renamed config field, an older checkpoint) or refused in one
sentence saying what to write instead (a moved module, a removed field, hyperparameter or method attribute); none is
silently dropped. A plug-in registers the migrations of its own fields here (:func:`register_moved_field`); a method's
Params lists its removed hyperparameters (``removed_hyperparameters``)."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

from rayfed.stages import AfterFederationStage, PreFederationStage, PublicPassStage, Stage

# Modules and scripts --------------------------------------------------------------------------------------------------

# Modules that moved into subpackages: importing one by its old path fails in one sentence naming the new one.
MOVED_MODULES = {
    "rayfed.kinds": "rayfed.tasks.kinds", "rayfed.kind_protocols": "rayfed.tasks.kind_protocols",
    "rayfed.decoders": "rayfed.tasks.decoders", "rayfed.text_metrics": "rayfed.tasks.text_metrics",
    "rayfed.report": "rayfed.results.report", "rayfed.checkpoint": "rayfed.results.checkpoint",
    "rayfed.metrics": "rayfed.results.derived_metrics", "rayfed.modules": "rayfed.models.peft.modules",
    "rayfed.models.attach": "rayfed.models.peft.attach", "rayfed.lora_groups": "rayfed.models.peft.lora_groups",
    "rayfed.models.named_adapters": "rayfed.models.peft.named_adapters",
    "rayfed.client_context": "rayfed.training.client_context", "rayfed.optimizers": "rayfed.training.optimizers",
    "rayfed.fast_steps": "rayfed.training", "rayfed.scoring": "rayfed.training.scoring",
    "rayfed.public_pass": "rayfed.training.public_pass", "rayfed.batching": "rayfed.training.plans.stacked",
    "rayfed.training.fast_steps": "rayfed.training", "rayfed.training.batching": "rayfed.training.plans.stacked",
    "rayfed.streams": "rayfed.data.streams", "rayfed.clip": "rayfed.models.families.clip",
}  # fmt: skip
# Scripts that left the installed package for the repository's benchmarks/papers/ (run from the checkout's root, or
# with --repo): importing or running one by its old module path fails in one sentence naming the command. By module:
# rayfed.methods.experiments(.<script>), rayfed.methods.<paper>.<kind> and rayfed.benchmarks.<script>.
SCRIPT_KINDS = {"tables": "tables", "configs": "configs", "paper_configs": "configs", "costs": "costs",
                "others": "others"}
FORMER_BENCHMARK_SCRIPTS = ("offline_runs", "offline_twins")


def moved_script(name: str) -> str | None:
    """The file under benchmarks/papers/ that module ``name`` became, or None when it names no moved script."""
    parts = name.split(".")
    if parts == ["rayfed", "methods", "experiments"]:  # a script under it is asked for after its package
        return f"{' or '.join(f'{script}.py' for script in FORMER_BENCHMARK_SCRIPTS)}"
    if parts[:2] == ["rayfed", "methods"] and len(parts) == 4 and parts[3] in SCRIPT_KINDS:
        return f"{parts[2]}_{SCRIPT_KINDS[parts[3]]}.py"
    if parts[:2] == ["rayfed", "benchmarks"] and len(parts) == 3 and parts[2] in FORMER_BENCHMARK_SCRIPTS:
        return f"{parts[2]}.py"
    return None


def moved_module(old: str) -> str | None:
    """The sentence for module ``old``, which moved (:data:`MOVED_MODULES`, :func:`moved_script`); None for any other
    module."""
    if old in MOVED_MODULES:
        return f"{old} moved to {MOVED_MODULES[old]}; import it from there."
    script = moved_script(old)
    if script is not None:
        return (f"{old} is no longer part of the installed package: run python benchmarks/papers/{script} from the "
                "repository's root (or with --repo PATH).")
    return None


class MovedModuleFinder:
    """Asked after the other finders, for a module none of them found; answers only for the moved ones."""

    @staticmethod
    def find_spec(name: str, path: object = None, target: object = None) -> None:
        sentence = moved_module(name)
        if sentence is not None:
            raise ImportError(sentence, name=name)


def install_moved_module_finder() -> None:
    if not any(type(finder).__name__ == MovedModuleFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


# Config fields --------------------------------------------------------------------------------------------------------

# Config fields read under their earlier names: {section: {old name: current name}}; setting both is refused.
RENAMED_FIELDS: dict[str, dict[str, str]] = {"data": {"synthetic": "options"}}
# Config fields a plug-in replaced, refused with its sentence: {"data.<key>": what to write instead}.
_MOVED_FIELDS: dict[str, str] = {}


def renamed_fields(section: str, raw: Any) -> Any:
    """``raw`` (config section ``section``, as written) with each earlier field name replaced by its current one."""
    if not isinstance(raw, dict):
        return raw
    for old, new in RENAMED_FIELDS.get(section, {}).items():
        if old in raw:
            if raw.get(new) is not None:
                raise ValueError(f"{section}.{old} and {section}.{new} are both set; {section}.{old} is the old name "
                                 f"of {section}.{new}, keep one")
            raw = {**{k: v for k, v in raw.items() if k != old}, new: raw[old]}
    return raw


def register_moved_field(field: str, sentence: str) -> None:
    """Refuse config field ``field`` (``data.<key>``), which a plug-in replaced, with ``sentence``: one sentence
    saying what to write instead. A package registers this beside the plug-in that replaced the field."""
    _MOVED_FIELDS[field] = sentence


def moved_field(field: str) -> str | None:
    """What to write instead of config field ``field``, where a plug-in replaced it; None for any other field.
    Plug-ins register theirs as their modules load, so every listed plug-in module is loaded first."""
    from rayfed import registry

    registry.load_plugins()
    return _MOVED_FIELDS.get(field)


# Method hyperparameters and attributes --------------------------------------------------------------------------------

# Class attributes a Method subclass once declared and rayfed no longer reads: {attribute: what to declare instead}.
REMOVED_METHOD_ATTRIBUTES = {
    "presums_uploads": "declare aggregation = rayfed.WeightedMean() instead of True, or rayfed.EachUpload() instead "
                       "of False",
    "batchable_updates": "a method whose hook changes the model's own settings before a plain train call runs with "
                         "train.batch_clients: 1 instead of False",
}


def check_method_attributes(cls: type) -> None:
    """Refuse a Method subclass that declares an attribute rayfed no longer reads, in one sentence."""
    for attribute, instead in REMOVED_METHOD_ATTRIBUTES.items():
        if attribute in vars(cls):
            raise TypeError(f"{cls.__name__} sets {attribute}, which rayfed no longer reads: {instead}.")


def removed_hyperparameter(params_cls: type, key: str) -> str | None:
    """What to set instead of hyperparameter ``key``, which ``params_cls`` no longer has: its Params class's
    ``removed_hyperparameters`` (``{name: what to set instead}``); None for a name it never had."""
    return getattr(params_cls, "removed_hyperparameters", {}).get(key)


# Method stages --------------------------------------------------------------------------------------------------------

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


# Checkpoints ----------------------------------------------------------------------------------------------------------

def checkpoint_fingerprint(meta: dict[str, Any], fingerprint: Callable[[dict[str, Any]], str]) -> str:
    """The config fingerprint a checkpoint's ``meta.json`` was written with: recorded, or (an older checkpoint, which
    kept only the config) ``fingerprint`` of its recorded config."""
    return meta.get("fingerprint") or fingerprint(meta.get("config", {}))
