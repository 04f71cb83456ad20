"""The options of TAP's modular model and how it reads a run's tasks: their modalities, their task key (TAP's task
o), the decoder each uses, and the backbone families it is built from (docs/tap.md#the-model)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from annotated_types import Interval

from rayfed.errors import ConfigError, suggest
from rayfed.models import Backbone
from rayfed.models.client_plugin import OPTIONS_FIELD
from rayfed.param_names import task_key as run_task_key
from rayfed.params import AtLeastOne, hyperparameters
from rayfed.tasks import Task

IMAGE, TEXT, SHARED = "image", "text", "shared"
MODALITIES = (IMAGE, TEXT)
TASK_KEYS = ("image_classification", "image_generation", "text_classification", "text_generation")
FAMILIES = ("flava", "vilt")
# Per family (Table 21 and the code; docs/tap.md#the-model): the LoRA ranks of the encoders, the backbone's
# attention and the experts (alpha = 2 rank everywhere), L, and the bottleneck of FedDAT's expert adapters.
FAMILY_DEFAULTS: dict[str, dict[str, int]] = {
    "flava": {"encoder_rank": 8, "attention_rank": 16, "expert_rank": 4, "layers": 1, "adapter_dim": 32},
    "vilt": {"encoder_rank": 4, "attention_rank": 8, "expert_rank": 8, "layers": 4, "adapter_dim": 16},
}


@hyperparameters
class MoMEOptions:
    """The modular model's architecture (docs/tap.md#hyperparameters); None takes the backbone family's value."""

    layers: AtLeastOne | None = None  # L: MoTE from pretrained layers 0..L-1, MoME from L..2L-1 (FLAVA 1, ViLT 4)
    # FLAVA: LoRA on the encoders' query/value (8); ViLT: on the patch projection (4)
    encoder_rank: AtLeastOne | None = None
    attention_rank: AtLeastOne | None = None  # LoRA on the backbone's query/value (FLAVA 16, ViLT 8)
    expert_rank: AtLeastOne | None = None  # LoRA on both linears of every expert (FLAVA 4, ViLT 8)
    lora_dropout: Annotated[float, Interval(ge=0, lt=1)] = 0.3
    domains: dict[str, str] | None = None  # task name -> domain of its MoDE experts; default: one per task
    text_positions: AtLeastOne = 32  # the text decoder's output positions (the longest target it can produce)
    condition_text_decoder: bool = True  # False: the released code's decoder, which never reads the features
    # the image adaptor's init: default (the code's), identity; none: resize only
    input_adaptor: Literal["default", "identity", "none"] = "default"
    # lora: LoRA on the backbone's attention and experts (TAP); adapter: none, a bottleneck adapter set after every
    # expert's FFN instead (FedDAT in this model, docs/tap.md#baselines: Linear D -> b, ReLU, Linear b -> D, residual)
    backbone_module: Literal["lora", "adapter"] = "lora"
    adapter_dim: AtLeastOne | None = None  # b of the expert adapters (FLAVA 32, ViLT 16)

    @classmethod
    def parse(cls, values: Mapping[str, Any] | None, where: str = OPTIONS_FIELD) -> MoMEOptions:
        """The options of the mapping at config field ``where``; one sentence naming the key when one is wrong."""
        values = dict(values or {})
        allowed = [f.name for f in dataclasses.fields(cls)]
        unknown = [key for key in values if key not in allowed]
        if unknown:
            raise ConfigError(f"{where} has no option {unknown[0]!r}{suggest(unknown[0], allowed)}; allowed: "
                              f"{', '.join(allowed)}.")
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}.{str(err).rstrip('.')}.") from None


def family_of(backbone: Backbone) -> str:
    """``flava`` or ``vilt``: the backbones the modular model is built from."""
    name = type(backbone.encoder).__name__
    if name == "FlavaModel":
        return "flava"
    if name == "ViltModel":
        return "vilt"
    raise ConfigError(f"{backbone.config_field} = {backbone.name!r} is a {name}; TAP's modular model is built from "
                      "FLAVA or ViLT (tiny-pretrained:flava, tiny-pretrained:vilt, hf:facebook/flava-full, "
                      "hf:dandelin/vilt-b32-mlm).")


def task_modalities(task: Task) -> tuple[str, ...]:
    """The task's input modalities in a fixed order (image first)."""
    if not task.modalities:
        raise ConfigError(f"task {task.name!r} does not record its input modalities (Task.modalities); the modular "
                          "model routes by them.")
    return tuple(m for m in MODALITIES if m in task.modalities)


def task_key(task: Task) -> str:
    """TAP's task o of a run task (docs/tap.md#the-model): ``image_classification`` (any classification with an image),
    ``text_classification``, ``image_generation`` (reconstruction), ``text_generation``."""
    kind = task.kind.name
    if kind == "reconstruction":
        return "image_generation"
    if kind == "text_generation":
        return "text_generation"
    if kind == "classification":
        return "image_classification" if IMAGE in task_modalities(task) else "text_classification"
    raise ConfigError(f"task {task.name!r} is of kind {kind!r}; TAP's modular model runs classification, "
                      "reconstruction and text_generation tasks.")


def head_key(task: Task) -> str:
    """The decoder a task uses: its own classifier, or the one head of its generation kind."""
    key = task_key(task)
    return key if key.endswith("generation") else run_task_key(task.index)


# What a method's Params says of its former ``mome`` hyperparameter (its ``removed_hyperparameters``).
MOVED_TO_CLIENT_MODEL = {"mome": "set model.client: mome and move these options to model.client_options (a method "
                                 "entry's own model: mapping sets both for that method alone)"}
