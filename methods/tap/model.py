"""TAP's modular multi-modal, multi-task model (*TAP: Two-Stage Adaptive Personalization of Multi-Task and
Multi-Modal Foundation Models in Federated Learning*, arXiv 2509.26524, §3, App. A.2 and D.1;
docs/tap.md#the-model), built from a pretrained FLAVA or ViLT.

- **Encoders**, one per modality: a trainable ``input_adaptor`` (images), the frozen pretrained encoder with
  LoRA (FLAVA: its image / text transformer, LoRA on query and value; ViLT: its patch projection with LoRA, or
  its frozen word embeddings), then a trainable ``Linear(hidden, D) -> LayerNorm``. Texts longer than the
  encoder's position table are encoded window by window.
- **Backbone** (MoTE -> MoME, from DisentAFL): a MoTE block per modality and a shared one, made of the
  pretrained layers ``0..L-1``, and a MoME block per task key and a shared one, made of layers ``L..2L-1``.
  A block layer is ``x += MHA(LN1(x))`` (frozen, LoRA on q and v; q and v first pass through a residual
  per-domain expert, "MoDE") then ``x += Expert(LN2(x))`` with the expert chosen by the route. Every expert is
  the layer's frozen pretrained FFN plus LoRA on both linears (``backbone_module: adapter``: no LoRA in the
  backbone, named bottleneck adapters after every expert's FFN instead, FedDAT's in this model,
  docs/tap.md#baselines).
  Routing is by metadata only: for the tokens of each input modality m of a task with key o
  (``image_classification``, ``image_generation``, ``text_classification``, ``text_generation``) four paths
  run::

      SS  shared_proj(x) -> mote[shared] / E^T[shared][shared] -> mome[shared] / E^M[shared][shared]
      ST  shared_proj(x) -> mote[m]      / E^T[shared][o]      -> mome[o]      / E^M[o][shared]
      MT  x              -> mote[m]      / E^T[m][o]           -> mome[o]      / E^M[o][m]
      MS  x              -> mote[m]      / E^T[m][shared]      -> mome[shared] / E^M[shared][m]

  each mean-pooled over its (real) tokens; the features are the mean over paths and modalities.
- **Decoders**: a classification head per classification task (dataset), ONE image-reconstruction head for all
  image-generation tasks, ONE text-generation head for all text-generation tasks (the code's parallel
  decoder: learned position queries attend to the pooled features, a 1-layer GPT-2, a linear map to the
  vocabulary; decoding is the argmax at every position).

Every block a task does not use is tagged with the tasks that do (:func:`rayfed.models.peft.modules.tag_tasks`), so a
client holds, trains and exchanges exactly the blocks of its modalities, tasks and domains. A "task" here is a
run's task (one dataset); TAP's task o is its key. :meth:`MoMEModel.path_prefixes` names the blocks on a
task's forward path (what TAP's replacement copies).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rayfed.errors import ConfigError
from rayfed.tasks.kinds import IGNORE, causal_from_target_logits
from rayfed.methods.tap.builders import (Routes, build_blocks, build_encoders, build_expert_tables, build_heads,
                                         expert_factory)
from rayfed.methods.tap.heads import decoded_tokens
from rayfed.methods.tap.layers import frozen_copy
from rayfed.methods.tap.options import (FAMILY_DEFAULTS, IMAGE, SHARED, TEXT, MoMEOptions, family_of, head_key,
                                        task_key, task_modalities)
from rayfed.models import Backbone, ClientModelRequest, TrainableModule
from rayfed.models.client_plugin import OPTIONS_FIELD
from rayfed.models.peft.modules import select_task
from rayfed.registry import register_client_model
from rayfed.tasks import Task
from rayfed.types import Batch


def _masked_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(tokens.dtype).unsqueeze(-1)
    return (tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)


def _key(name: str) -> str:
    """A domain name usable as a module key."""
    return name.replace(".", "_")


def _text_inputs(key: str, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The token ids and mask the text encoder reads: for text generation the prompt alone (``input_ids`` holds
    prompt + target)."""
    if key == "text_generation":
        return batch["prompt_ids"], batch["prompt_mask"]
    return batch["input_ids"], batch["attention_mask"]


class MoMEModel(TrainableModule):
    """The client (and server) model of TAP and its baselines; ``forward(batch)`` gives what the active task's
    kind scores (text generation: logits aligned as a causal LM's, see
    :func:`rayfed.tasks.kinds.causal_from_target_logits`), ``forward(batch, raw=True)`` the decoder's own output.
    With ``backbone_module: adapter`` every expert holds the named ``adapters`` (``frozen_adapters`` of them not
    trainable)."""

    generates_text = True  # text-generation tasks decode with the parallel text head (generate_text)

    def __init__(self, backbone: Backbone, tasks: Sequence[Task], options: MoMEOptions, seed: int,
                 adapters: Sequence[str] = ("shared",), frozen_adapters: Collection[str] = ()):
        super().__init__()
        family = family_of(backbone)
        defaults = FAMILY_DEFAULTS[family]
        option = {name: getattr(options, name) or defaults[name] for name in defaults}
        encoder = backbone.encoder
        layers = list(encoder.multimodal_model.encoder.layer if family == "flava" else encoder.encoder.layer)
        heads = (encoder.config.multimodal_config if family == "flava" else encoder.config).num_attention_heads
        self.num_layers = min(option["layers"], len(layers) // 2)
        if self.num_layers < 1:
            raise ConfigError(f"{backbone.config_field} = {backbone.name!r} has {len(layers)} layer(s); the MoTE and "
                              "MoME blocks need at least two.")
        width = backbone.feature_dim
        self.family, self.tokenizer, self.options = family, backbone.tokenizer, options
        self.tasks = {task.index: task for task in tasks}
        self.keys = {task.index: task_key(task) for task in tasks}
        self.task_modalities = {task.index: task_modalities(task) for task in tasks}
        domains = dict(options.domains or {})
        unknown = [name for name in domains if name not in {t.name for t in tasks}]
        if unknown:
            raise ConfigError(f"{OPTIONS_FIELD}.domains names task {unknown[0]!r}, which the run does not have.")
        self.domain = {task.index: _key(domains.get(task.name, task.name)) for task in tasks}
        self.active_task = tasks[0].index
        self.collected_latents: list[tuple[tuple[str, str], torch.Tensor]] | None = None  # DisentAFL's, when a list

        routes = Routes(self.task_modalities, self.keys, self.domain)
        torch.manual_seed(seed)
        dropout = options.lora_dropout
        lora = options.backbone_module == "lora"
        make_expert = expert_factory(lora, option, dropout, adapters, frozen_adapters)
        self.encoders = build_encoders(routes, backbone, family, width, option["encoder_rank"], dropout,
                                       options.input_adaptor)
        self.shared_proj = nn.Linear(width, width)
        # One frozen copy of each pretrained layer's FFN, under every expert made from it (only LoRA differs).
        ffns = [(frozen_copy(layer.intermediate.dense), frozen_copy(layer.output.dense))
                for layer in layers[:2 * self.num_layers]]
        self.mote, self.mome = build_blocks(routes, layers, ffns, self.num_layers, heads,
                                            option["attention_rank"] if lora else None, dropout, make_expert)
        self.mote_experts, self.mome_experts = build_expert_tables(routes, ffns, self.num_layers, make_expert)
        self.heads = build_heads(routes, tasks, backbone, family, width, options)

    # Routing -------------------------------------------------------------------------------------------
    def select_task(self, index: int) -> None:
        self.active_task = index

    def _experts(self, table: nn.ModuleDict, cells: Sequence[tuple[str, str]]) -> list[list[nn.Module]]:
        """Per layer, the expert of each (row, column) cell."""
        return [[table[str(layer)][row][column] for row, column in cells] for layer in range(self.num_layers)]

    def encode(self, batch: Batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The tokens and mask of each input modality of the active task."""
        task = self.active_task
        encoded = {}
        if IMAGE in self.task_modalities[task]:
            encoded[IMAGE] = self.encoders[IMAGE](batch["pixel_values"])
        if TEXT in self.task_modalities[task]:
            encoded[TEXT] = self.encoders[TEXT](*_text_inputs(self.keys[task], batch))
        return encoded

    def host_choices(self, task_index: int, batch: Batch) -> int | None:
        """How many windows the text encoder encodes for this batch's longest text (None: the task reads no text)."""
        if TEXT not in self.task_modalities[task_index]:
            return None
        return self.encoders[TEXT].windows(_text_inputs(self.keys[task_index], batch)[1])

    def making_choices(self, choices: int | None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if choices is None else self.encoders[TEXT].taking_windows(choices)

    def features(self, batch: Batch | torch.Tensor) -> torch.Tensor:
        """The pooled features (B, D): the mean of the four paths of every input modality."""
        batch = {"pixel_values": batch} if isinstance(batch, torch.Tensor) else batch
        task = self.active_task
        key, domain = self.keys[task], self.domain[task]
        pooled = []
        for modality, (tokens, mask) in self.encode(batch).items():
            projected = self.shared_proj(tokens)
            size = len(tokens)
            # MoTE: SS through mote[shared]; ST, MT and MS through mote[m], stacked along the batch.
            ss = self.mote[SHARED](projected, mask, self._experts(self.mote_experts, [(SHARED, SHARED)]), domain)
            st, mt, ms = self.mote[modality](
                torch.cat([projected, tokens, tokens]), mask.repeat(3, 1),
                self._experts(self.mote_experts, [(SHARED, key), (modality, key), (modality, SHARED)]), domain,
            ).split(size)
            if self.collected_latents is not None:
                self.collected_latents.append(((modality, key), _masked_mean(mt, mask)))
            # MoME: SS and MS through mome[shared], ST and MT through mome[o].
            ss, ms = self.mome[SHARED](torch.cat([ss, ms]), mask.repeat(2, 1),
                                       self._experts(self.mome_experts, [(SHARED, SHARED), (SHARED, modality)]),
                                       domain).split(size)
            st, mt = self.mome[key](torch.cat([st, mt]), mask.repeat(2, 1),
                                    self._experts(self.mome_experts, [(key, SHARED), (key, modality)]),
                                    domain).split(size)
            pooled += [_masked_mean(path, mask) for path in (ss, st, mt, ms)]
        return torch.stack(pooled).mean(dim=0)

    def forward(self, batch: Batch | torch.Tensor, raw: bool = False) -> torch.Tensor:
        batch = {"pixel_values": batch} if isinstance(batch, torch.Tensor) else batch
        task = self.tasks[self.active_task]
        key = head_key(task)
        features = self.features(batch)
        if key == "image_generation":
            return self.heads[key](features, task.image_shape)
        outputs = self.heads[key](features)
        if key != "text_generation" or raw:
            return outputs
        return self.aligned(outputs, batch)

    def aligned(self, raw: torch.Tensor, batch: Batch) -> torch.Tensor:
        """The text decoder's logits placed where the text-generation kind reads a causal LM's."""
        # Each row's target is in target_ids too (TextGeneration.encode): its width bounds every target's length
        # without reading the labels back to the host.
        if "target_ids" not in batch or batch["target_ids"].shape[1] > raw.shape[1]:
            longest = int((batch["labels"] != IGNORE).sum(dim=1).max())
            if longest > raw.shape[1]:
                raise ConfigError(f"a target of {longest} tokens is longer than the text decoder's "
                                  f"{OPTIONS_FIELD}.text_positions = {raw.shape[1]}; raise it.")
        return causal_from_target_logits(raw, batch)

    def raw_and_scored(self, batch: Batch, forward: Callable[..., torch.Tensor] | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder's own outputs (what distillation compares; text generation: the logits of every output
        position) and what the active task's kind scores, from one forward."""
        raw = (forward or self)(batch, raw=True)
        return raw, self.aligned(raw, batch) if self.keys[self.active_task] == "text_generation" else raw

    @torch.no_grad()
    def generate_text(self, batch: Batch, max_new_tokens: int) -> torch.Tensor:
        """The argmax token at every position, cut after the first end-of-text (pad after it)."""
        return decoded_tokens(self(batch, raw=True), self.tokenizer, max_new_tokens)

    @torch.no_grad()
    def logits_and_generations(self, batch: Batch, max_new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(batch)`` and ``generate_text(batch, max_new_tokens)`` from one forward."""
        raw = self(batch, raw=True)
        return self.aligned(raw, batch), decoded_tokens(raw, self.tokenizer, max_new_tokens)

    # Blocks ---------------------------------------------------------------------------------------------
    def path_prefixes(self, task_index: int) -> tuple[str, ...]:
        """The name prefixes of every block on the task's forward path (docs/tap.md#the-method, "Path of o"): the
        encoders of its modalities, shared_proj, mote[m] and mote[shared], mome[o] and mome[shared] (whole blocks,
        their domain experts included), the eight expert cells of each modality in every layer, and its head."""
        key = self.keys[task_index]
        prefixes = ["shared_proj.", f"mote.{SHARED}.", f"mome.{SHARED}.", f"mome.{key}.",
                    f"heads.{head_key(self.tasks[task_index])}."]
        for modality in self.task_modalities[task_index]:
            prefixes += [f"encoders.{modality}.", f"mote.{modality}."]
            for layer in range(self.num_layers):
                prefixes += [f"mote_experts.{layer}.{row}.{column}." for row, column in
                             ((SHARED, SHARED), (SHARED, key), (modality, key), (modality, SHARED))]
                prefixes += [f"mome_experts.{layer}.{row}.{column}." for row, column in
                             ((SHARED, SHARED), (key, SHARED), (key, modality), (SHARED, modality))]
        return tuple(dict.fromkeys(prefixes))

    def on_path(self, name: str, task_indices: Sequence[int]) -> bool:
        """Whether parameter ``name`` is on the forward path of any of ``task_indices``."""
        return any(name.startswith(self.path_prefixes(t)) for t in task_indices)


def build_mome_model(backbone: Backbone, tasks: Sequence[Task], options: MoMEOptions | Mapping[str, Any] | None,
                     seed: int, adapters: Sequence[str] = ("shared",), frozen_adapters: Collection[str] = (),
                     ) -> MoMEModel:
    """TAP's modular model over ``backbone`` for ``tasks``; its initial values depend on ``seed`` only. With
    ``backbone_module: adapter``, each expert's adapter set is ``adapters`` (``shared`` among them: the one its
    forward uses unless a mixture is set), ``frozen_adapters`` not trainable."""
    if not isinstance(options, MoMEOptions):
        options = MoMEOptions.parse(options)
    if options.backbone_module == "adapter" and "shared" not in adapters:
        raise ConfigError(f"the expert adapters {list(adapters)} lack 'shared', the one an expert's forward uses.")
    return MoMEModel(backbone, tasks, options, seed, adapters, frozen_adapters)


@register_client_model("mome")
def mome_client_model(request: ClientModelRequest) -> MoMEModel:
    """TAP's modular multi-modal, multi-task model over a FLAVA or ViLT backbone (options: :class:`MoMEOptions`);
    a method's adapter sets go after every expert's FFN (``backbone_module: adapter``, the default then)."""
    sets = request.adapter_sets
    if sets is None:
        return build_mome_model(request.backbone, request.tasks, request.options, request.seed)
    options = MoMEOptions.parse({"backbone_module": "adapter", **request.options})
    if options.backbone_module != "adapter":
        raise ConfigError(f"{OPTIONS_FIELD}.backbone_module must be adapter for methods ({sets.method}), which trains "
                          "adapter sets after the experts.")
    return build_mome_model(request.backbone, request.tasks, options, request.seed, sets.names, sets.frozen)


def task_outputs(model: nn.Module, task: Task, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The modular model's outputs on ``task``'s ``batch``: the decoder's own (what distillation compares; text
    generation: the logits of every output position) and what the task's kind scores."""
    select_task(model, task.index)
    return model.raw_and_scored(batch)
