"""The parts of TAP's modular model (:class:`rayfed.methods.tap.model.MoMEModel`, docs/tap.md#the-model), each built
for the tasks that use it: the encoders, the MoTE and MoME blocks, the expert tables and the decoders. A part no
task of the model uses is not built; one that only some use is tagged with them
(:func:`rayfed.models.peft.modules.tag_tasks`). The model calls them in a fixed order, which fixes its random draws.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from rayfed.errors import ConfigError
from rayfed.methods.tap.encoders import ImageEncoder, TextEncoder
from rayfed.methods.tap.heads import ClassificationHead, ImageGenerationHead, TextGenerationHead
from rayfed.methods.tap.layers import Expert, ExpertFactory, MoEBlock
from rayfed.methods.tap.options import IMAGE, MODALITIES, SHARED, TASK_KEYS, TEXT, MoMEOptions, head_key
from rayfed.models import Backbone
from rayfed.models.peft.modules import adapter_set, tag_tasks
from rayfed.tasks import Task


@dataclass(frozen=True)
class Routes:
    """Which of the model's tasks (by index) use what: each task's input modalities, task key and domain."""

    task_modalities: Mapping[int, Sequence[str]]
    keys: Mapping[int, str]
    domain: Mapping[int, str]

    @property
    def every(self) -> frozenset[int]:
        return frozenset(self.keys)

    @property
    def modalities(self) -> list[str]:
        """The input modalities some task reads, in the order of MODALITIES."""
        return [m for m in MODALITIES if any(m in self.task_modalities[t] for t in self.every)]

    @property
    def task_keys(self) -> list[str]:
        """The task keys of the tasks, in the order of TASK_KEYS."""
        return [k for k in TASK_KEYS if k in self.keys.values()]

    def users(self, modality: str | None = None, key: str | None = None, domain: str | None = None) -> frozenset[int]:
        """The tasks of ``modality``, ``key`` and ``domain`` (each: any, if None)."""
        return frozenset(t for t in self.every if (modality is None or modality in self.task_modalities[t])
                         and (key is None or self.keys[t] == key) and (domain is None or self.domain[t] == domain))

    def tagged(self, module: nn.Module, tasks_using: frozenset[int]) -> nn.Module:
        """``module`` tagged with ``tasks_using``, unless every task uses it."""
        return module if tasks_using == self.every else tag_tasks(module, tasks_using)


def expert_factory(lora: bool, option: Mapping[str, Any], dropout: float, adapters: Sequence[str],
                   frozen_adapters: Collection[str]) -> ExpertFactory:
    """Makes an expert of a layer's FFN: LoRA on both linears (``lora``), else the named adapter set after it."""

    def make_expert(first: nn.Linear, second: nn.Linear) -> Expert:
        if lora:
            return Expert(first, second, option["expert_rank"], dropout)
        return Expert(first, second, None, dropout, adapter_set(adapters, second.out_features, option["adapter_dim"],
                                                                "relu", "normal", frozen_adapters))

    return make_expert


def build_encoders(routes: Routes, backbone: Backbone, family: str, width: int, rank: int, dropout: float,
                   input_adaptor: Any) -> nn.ModuleDict:
    """One encoder per input modality some task reads."""
    built = {}
    if IMAGE in routes.modalities:
        built[IMAGE] = routes.tagged(ImageEncoder(backbone, family, width, rank, dropout, input_adaptor),
                                     routes.users(IMAGE))
    if TEXT in routes.modalities:
        built[TEXT] = routes.tagged(TextEncoder(backbone, family, width, rank, dropout), routes.users(TEXT))
    return nn.ModuleDict(built)


def build_blocks(routes: Routes, layers: Sequence[nn.Module], ffns: Sequence[tuple[nn.Module, nn.Module]],
                 num_layers: int, heads: int, attention_rank: int | None, dropout: float,
                 make_expert: ExpertFactory) -> tuple[nn.ModuleDict, nn.ModuleDict]:
    """The MoTE blocks (one per modality and a shared one, of layers ``0..L-1``) and the MoME blocks (one per task key
    and a shared one, of layers ``L..2L-1``), each block's per-domain q and v experts tagged with their domain's
    tasks."""

    def block(first_layer: int, tasks_using: frozenset[int]) -> nn.Module:
        used = sorted({routes.domain[t] for t in tasks_using})
        chosen = range(first_layer, first_layer + num_layers)
        made = MoEBlock([layers[i] for i in chosen], [ffns[i] for i in chosen], heads, attention_rank, dropout, used,
                        make_expert)
        for name in used:
            for layer in made.layers:
                routes.tagged(layer.mode_q[name], tasks_using & routes.users(domain=name))
                routes.tagged(layer.mode_v[name], tasks_using & routes.users(domain=name))
        return routes.tagged(made, tasks_using)

    mote = nn.ModuleDict({m: block(0, routes.users(m)) for m in routes.modalities} | {SHARED: block(0, routes.every)})
    mome = nn.ModuleDict({k: block(num_layers, routes.users(key=k)) for k in routes.task_keys}
                         | {SHARED: block(num_layers, routes.every)})
    return mote, mome


def build_expert_tables(routes: Routes, ffns: Sequence[tuple[nn.Module, nn.Module]], num_layers: int,
                        make_expert: ExpertFactory) -> tuple[nn.ModuleDict, nn.ModuleDict]:
    """E^T[l][mod | shared][key | shared] and E^M[l][key | shared][mod | shared], only the cells a task uses; layer
    l's experts of E^T made from FFN l, those of E^M from FFN L + l."""
    modalities, keys = [*routes.modalities, SHARED], [*routes.task_keys, SHARED]

    def users(modality: str, key: str) -> frozenset[int]:
        return routes.users(None if modality == SHARED else modality, None if key == SHARED else key)

    def expert(layer: int, tasks_using: frozenset[int]) -> nn.Module:
        return routes.tagged(make_expert(*ffns[layer]), tasks_using)

    mote_experts, mome_experts = {}, {}
    for index in range(num_layers):
        mote_experts[str(index)] = nn.ModuleDict({m: nn.ModuleDict({k: expert(index, users(m, k)) for k in keys
                                                                    if users(m, k)}) for m in modalities})
        mome_experts[str(index)] = nn.ModuleDict({k: nn.ModuleDict({m: expert(num_layers + index, users(m, k))
                                                                    for m in modalities if users(m, k)})
                                                  for k in keys})
    return nn.ModuleDict(mote_experts), nn.ModuleDict(mome_experts)


def build_heads(routes: Routes, tasks: Sequence[Task], backbone: Backbone, family: str, width: int,
                options: MoMEOptions) -> nn.ModuleDict:
    """A classification head per classification task, one image-generation head for every image-generation task
    (as wide as the largest image), one text-generation head for every text-generation task."""
    heads: dict[str, nn.Module] = {}
    for task in tasks:
        key = head_key(task)
        if key in heads:
            continue
        if key == "image_generation":
            size = max(max(t.image_shape[1:]) for t in tasks if head_key(t) == key)
            heads[key] = routes.tagged(ImageGenerationHead(width, size), routes.users(key=key))
        elif key == "text_generation":
            if backbone.tokenizer is None:
                raise ConfigError(f"{backbone.config_field} = {backbone.name!r} has no tokenizer for text generation.")
            heads[key] = routes.tagged(TextGenerationHead(width, len(backbone.tokenizer), options.text_positions,
                                                          options.condition_text_decoder), routes.users(key=key))
        else:
            heads[key] = tag_tasks(ClassificationHead(family, width, task.num_classes), [task.index])
    return nn.ModuleDict(heads)
